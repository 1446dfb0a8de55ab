"""DiffEqFormer language model: embed → ODE solve of dx/dt = f(x, t) on [0, 1] → norm → head.

The number of solver steps N is a per-call setting, not a parameter count. Pieces exposed for
analysis (Jacobians, trajectories, spectra) and for export:
- ``embed(tokens, positions)`` → x₀ (float32 [B, T, E]);
- ``vector_field(x, t, positions, segment_ids)`` → f(x, t), a pure function of x and t;
- ``logits(x)`` → float32 [B, T, V] (final norm + head);
- ``weights_at(t)`` → the static block weights at depth t (see vector_field.py for layout);
- ``trajectory(tokens, ...)`` → [N+1, B, T, E] solver states.

The ODE state x stays float32 (the solver accumulates dt·f into it); the branches compute in
``config.dtype``. Randomness (dropout, random grid offset) is drawn from ``rngs.dropout()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models import solvers
from ode_lm.models.common import attention_mask, default_inputs, remat_policy
from ode_lm.models.config import ModelConfig
from ode_lm.models.embeddings import LanguageModel
from ode_lm.models.vector_field import BlockWeights, TemporalBlock, parallel_residual


class DiffEqFormer(LanguageModel):
    """The Neural ODE transformer of the paper (``architecture='ode'``)."""

    _architecture = "ode"

    def build_body(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.block = TemporalBlock(config, rngs)

    # ---- pieces (embed and logits: LanguageModel) ---------------------------------------------
    def weights_at(self, t: jax.Array | float) -> BlockWeights:
        return self.block.weights(t)

    def vector_field(
        self,
        x: jax.Array,
        t: jax.Array | float,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        weights: BlockWeights | None = None,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array:
        """f(x, t) = Attn_t(Norm1_t(x)) + MLP_t(Norm2_t(x)), float32 [B, T, E]."""
        positions, segment_ids = default_inputs(x[..., 0], positions, segment_ids)
        w = self.block.weights(t) if weights is None else weights
        return parallel_residual(self.config, w, x, positions, attention_mask(segment_ids),
                                 dropout_key, segment_ids=segment_ids)

    # ---- the solve ----------------------------------------------------------------------------
    def solve(
        self,
        x0: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        num_steps: int | jax.Array | None = None,
        solver: str | None = None,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
        return_trajectory: bool = False,
        max_steps: int | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        return_stats: bool = False,
    ):
        """x_N (and the trajectory, and/or solver stats) of the ODE started at x0.

        Fixed grid (``_solve_fixed``): ``num_steps`` is an int, or a traced int32 with a
        static ``max_steps`` bound (random step counts in training: one compiled program for
        every N). Adaptive (``solver`` in ADAPTIVE_SOLVERS, ``_solve_adaptive``): W(t) is
        generated at whatever t the controller picks; ``rtol``/``atol`` default to the
        config's. ``return_stats`` adds ``{"nfe": vector-field evaluations}`` and, on the
        fixed grid without a trajectory, ``"kinetic_energy": ∫ mean(f²) dt`` (adaptive:
        ``"capped"``) to the result.
        """
        cfg = self.config
        solver = cfg.solver if solver is None else solver
        solvers.check_solver(solver, adaptive_ok=True)
        if solvers.is_adaptive(solver):
            if return_trajectory:
                raise ValueError(f"DiffEqFormer: solver={solver!r} has no fixed grid to return "
                                 "as a trajectory; use a fixed-grid solver")
            x, stats = self._solve_adaptive(x0, positions, segment_ids, solver,
                                            cfg.rtol if rtol is None else rtol,
                                            cfg.atol if atol is None else atol)
            return (x, stats) if return_stats else x
        grid = solvers.FixedGrid(cfg.num_steps if num_steps is None else num_steps, max_steps)
        if not deterministic and (cfg.dropout_rate > 0 or cfg.random_grid_offset) and rngs is None:
            raise ValueError("DiffEqFormer: deterministic=False with dropout_rate > 0 or "
                             "random_grid_offset needs rngs=nnx.Rngs(dropout=...)")
        out, stats = self._solve_fixed(x0, positions, segment_ids, grid, solver,
                                       rngs=None if deterministic else rngs,
                                       return_trajectory=return_trajectory,
                                       kinetic=return_stats and not return_trajectory)
        return (out, stats) if return_stats else out

    def _solve_adaptive(self, x0, positions, segment_ids, solver: str, rtol: float,
                        atol: float) -> tuple[jax.Array, dict]:
        """dx/dt = f(x, t) with W(t) generated at the controller's t (no randomness)."""
        mask = attention_mask(segment_ids)

        def field(x, t):
            return parallel_residual(self.config, self.block.weights(t), x, positions, mask,
                                     None, segment_ids=segment_ids)

        x, st = solvers.solve_adaptive(field, x0, solver=solver, rtol=rtol, atol=atol)
        return x, {"nfe": st.nfe, "capped": st.capped}

    def _solve_fixed(self, x0, positions, segment_ids, grid: solvers.FixedGrid, solver: str,
                     *, rngs: nnx.Rngs | None, return_trajectory: bool, kinetic: bool):
        """x_{k+1} = x_k + dt·Σ_i b_i·f(X_i, t_k + c_i·dt + δ) on ``grid`` (RK stages X_i).

        Training randomness (``rngs`` given): δ, the random grid offset (one draw per solve,
        see ``_grid_offset``), and per-step dropout keys. With ``kinetic`` the state is
        augmented (Finlay et al. 2020) by e(t) = ∫ mean(f²) dt, integrated by the same solver
        at no extra evaluation; it is kept per sequence ([B], sharded like the batch) so the
        step holds no cross-device reduction, and averaged over the batch after the solve.
        """
        cfg = self.config
        mask = attention_mask(segment_ids)
        needs_dropout = rngs is not None and cfg.dropout_rate > 0
        needs_offset = rngs is not None and cfg.random_grid_offset
        offset = self._grid_offset(grid, solver, rngs) if needs_offset else 0.0
        step_inputs = {}
        if precompute_weights(cfg, grid.length, solver):
            # W(t) for every stage of every step as one [N·stages, D] × [D, P] contraction.
            times = grid.times(solver) + offset
            step_inputs["w"] = jax.tree.map(lambda a: a.reshape(times.shape + a.shape[1:]),
                                            self.block.weights(times.reshape(-1)))
        if needs_dropout:
            step_inputs["key"] = jax.random.split(rngs.dropout(), grid.length)

        def f(x, t, inp=None, stage=0):
            w = self.block.weights(t) if "w" not in step_inputs else jax.tree.map(
                lambda a: a[stage], inp["w"])
            key = jax.random.fold_in(inp["key"], stage) if needs_dropout else None
            return parallel_residual(cfg, w, x, positions, mask, key, segment_ids=segment_ids)

        def f_and_energy(s, t, *a):
            d = f(s[0], t, *a)
            return d, jnp.mean(jnp.square(d), axis=(1, 2))

        out = solvers.solve_on_grid(
            f_and_energy if kinetic else f,
            (x0, jnp.zeros(x0.shape[:1], jnp.float32)) if kinetic else x0, grid,
            solver=solver, time_offset=offset, step_inputs=step_inputs or None,
            return_trajectory=return_trajectory, remat=remat_policy(cfg.remat))
        stats = {"nfe": jnp.asarray(grid.num_steps * solvers.num_stages(solver), jnp.int32)}
        if kinetic:
            out, energy = out
            stats["kinetic_energy"] = jnp.mean(energy)
        return out, stats

    @staticmethod
    def _grid_offset(grid: solvers.FixedGrid, solver: str, rngs: nnx.Rngs) -> jax.Array:
        """The random grid offset: u ~ U[0, dt), one draw per solve. Euler evaluates at
        t_{k+1} − u ∈ [t_k, t_{k+1}); RK stages shift by u − dt/2."""
        u = jax.random.uniform(rngs.dropout(), (), minval=0.0, maxval=grid.dt)
        return -u if solver == "euler" else u - grid.dt / 2

    def body(self, x0: jax.Array, positions: jax.Array, segment_ids: jax.Array, **options):
        """The ODE solve from x₀ (``LanguageModel.__call__``'s body; ``solve``'s options)."""
        return self.solve(x0, positions, segment_ids, **options)

    def trajectory(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        num_steps: int | None = None,
        solver: str | None = None,
    ) -> jax.Array:
        """Solver states [N+1, B, T, E] (x₀ first), deterministic."""
        positions, segment_ids = default_inputs(tokens, positions, segment_ids)
        x0 = self.embeddings(tokens, positions)
        _, traj = self.solve(x0, positions, segment_ids, num_steps=num_steps, solver=solver,
                             return_trajectory=True)
        return traj


def precompute_weights(config: ModelConfig, num_steps: int, solver: str) -> bool:
    """Whether the solve generates all W(t_k) up front (one contraction that reads A once,
    and writes dA once in the backward pass) rather than inside each scan step (which
    reads A, and accumulates dA, at every step). ``auto`` precomputes while the N·stages
    generated weight sets take no more memory than the D coefficient sets."""
    if not config.time_dependent or config.weight_generation == "in_scan":
        return False
    if config.weight_generation == "precompute":
        return True
    return num_steps * solvers.num_stages(solver) <= config.time_embed_dim


def weights_at(model: DiffEqFormer, t: jax.Array | float) -> BlockWeights:
    """Static block weights at depth t: dict name → float32 array (layout in vector_field.py).

    Accepts a scalar t; vmap it for many t (``jax.vmap(lambda t: weights_at(model, t))``).
    """
    if not isinstance(model, DiffEqFormer):
        raise TypeError(f"weights_at: expected a DiffEqFormer, got {type(model).__name__}")
    return model.weights_at(jnp.asarray(t, jnp.float32))
