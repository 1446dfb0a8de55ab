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

        Fixed grid: ``num_steps`` is an int, or a traced int32 with a static ``max_steps``
        bound (random step counts in training: one compiled program for every N).
        Adaptive (``solver`` in ADAPTIVE_SOLVERS): W(t) is generated at whatever t the
        controller picks; ``rtol``/``atol`` default to the config's. ``return_stats`` adds
        ``{"nfe": vector-field evaluations, "kinetic_energy": ∫ mean(f²) dt}`` (fixed grid,
        without a trajectory) to the result.
        """
        cfg = self.config
        solver = cfg.solver if solver is None else solver
        solvers.check_solver(solver, adaptive_ok=True)
        mask = attention_mask(segment_ids)
        if solvers.is_adaptive(solver):
            if return_trajectory:
                raise ValueError(f"DiffEqFormer: solver={solver!r} has no fixed grid to return "
                                 "as a trajectory; use a fixed-grid solver")

            def field(x, t):
                return parallel_residual(cfg, self.block.weights(t), x, positions, mask, None,
                                         segment_ids=segment_ids)

            x, st = solvers.solve_adaptive(
                field, x0, solver=solver, rtol=cfg.rtol if rtol is None else rtol,
                atol=cfg.atol if atol is None else atol)
            return (x, {"nfe": st.nfe, "capped": st.capped}) if return_stats else x
        num_steps = cfg.num_steps if num_steps is None else num_steps
        dynamic = not isinstance(num_steps, int)
        if dynamic and max_steps is None:
            raise ValueError("DiffEqFormer: a traced num_steps needs a static max_steps")
        if not dynamic and num_steps < 1:
            raise ValueError(f"DiffEqFormer: num_steps={num_steps!r} must be a positive int")
        length = max_steps if dynamic else num_steps
        dt = 1.0 / (jnp.asarray(num_steps, jnp.float32) if dynamic else num_steps)
        needs_dropout = not deterministic and cfg.dropout_rate > 0
        needs_offset = not deterministic and cfg.random_grid_offset
        if (needs_dropout or needs_offset) and rngs is None:
            raise ValueError("DiffEqFormer: deterministic=False with dropout_rate > 0 or "
                             "random_grid_offset needs rngs=nnx.Rngs(dropout=...)")
        offset = 0.0
        if needs_offset:
            u = jax.random.uniform(rngs.dropout(), (), minval=0.0, maxval=dt)
            # Euler evaluates at t_{k+1} - u ∈ [t_k, t_{k+1}); RK stages shift by u - dt/2.
            offset = -u if solver == "euler" else u - dt / 2
        keys = jax.random.split(rngs.dropout(), length) if needs_dropout else None

        step_inputs = {}
        if precompute_weights(cfg, length, solver):
            # W(t) for every stage of every step as one [N·stages, D] × [D, P] contraction.
            times = solvers.evaluation_times(num_steps, solver,
                                             max_steps=length if dynamic else None) + offset
            step_inputs["w"] = jax.tree.map(lambda a: a.reshape(times.shape + a.shape[1:]),
                                            self.block.weights(times.reshape(-1)))
        if keys is not None:
            step_inputs["key"] = keys

        def f(x, t, inp=None, stage=0):
            w = self.block.weights(t) if "w" not in step_inputs else jax.tree.map(
                lambda a: a[stage], inp["w"])
            key = None if keys is None else jax.random.fold_in(inp["key"], stage)
            return parallel_residual(cfg, w, x, positions, mask, key, segment_ids=segment_ids)

        # With stats, the state is augmented (Finlay et al. 2020) by the kinetic energy
        # e(t) = ∫ mean(f²) dt, integrated by the same solver at no extra evaluation. It is
        # kept per sequence ([B], sharded like the batch) so the solver step holds no
        # cross-device reduction; the batch mean is taken after the solve.
        kinetic = return_stats and not return_trajectory
        field = (lambda s, t, *a: (lambda d: (d, jnp.mean(jnp.square(d), axis=(1, 2))))(
            f(s[0], t, *a))) if kinetic else f
        state0 = (x0, jnp.zeros(x0.shape[:1], jnp.float32)) if kinetic else x0
        out = solvers.solve(
            field, state0, num_steps=num_steps, solver=solver, time_offset=offset,
            step_inputs=step_inputs or None, return_trajectory=return_trajectory,
            remat=remat_policy(cfg.remat), max_steps=length if dynamic else None,
        )
        if not return_stats:
            return out
        stats = {"nfe": jnp.asarray(num_steps * solvers.num_stages(solver), jnp.int32)}
        if kinetic:
            out, energy = out
            stats["kinetic_energy"] = jnp.mean(energy)
        return out, stats

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        num_steps: int | jax.Array | None = None,
        solver: str | None = None,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
        max_steps: int | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        return_stats: bool = False,
    ):
        """Logits float32 [B, T, V] (and ``{"nfe": ...}`` with ``return_stats``)."""
        positions, segment_ids = default_inputs(tokens, positions, segment_ids)
        x0 = self.embeddings(tokens, positions)
        out = self.solve(x0, positions, segment_ids, num_steps=num_steps, solver=solver,
                         deterministic=deterministic, rngs=rngs, max_steps=max_steps,
                         rtol=rtol, atol=atol, return_stats=return_stats)
        if return_stats:
            return self.logits(out[0]), out[1]
        return self.logits(out)

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
