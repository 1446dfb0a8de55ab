"""DiffEqFormer language model: embed → ODE solve of dx/dt = f(x, t) on [0, 1] → norm → head.

The number of solver steps N is a per-call setting, not a parameter count. f is one
``VectorField`` (vector_field.py), which every piece below evaluates:
- ``embed(tokens, positions)`` → x₀ (float32 [B, T, E]);
- ``vector_field(x, t, positions, segment_ids)`` → f(x, t), a pure function of x and t;
- ``solve_fixed(x0, ...)`` → (x_N, stats): N steps of a Runge–Kutta solver (training, eval);
- ``solve_adaptive(x0, ...)`` → (x(1), stats): an embedded pair with step-size control;
- ``trajectory(tokens, ...)`` → [N+1, B, T, E] fixed-grid solver states;
- ``logits(x)`` → float32 [B, T, V] (final norm + head);
- ``weights_at(t)`` → the static block weights at depth t (see vector_field.py for layout).

The ODE state x stays float32 (the solver accumulates dt·f into it); the branches compute in
``config.dtype``. Randomness (dropout, random grid offset) is drawn from ``rngs.dropout()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models import solvers
from ode_lm.models.common import default_inputs, remat_policy
from ode_lm.models.config import ADAPTIVE_SOLVERS, ModelConfig
from ode_lm.models.embeddings import LanguageModel
from ode_lm.models.solve import OWN, Solve
from ode_lm.models.vector_field import BlockWeights, TemporalBlock, VectorField

Stats = dict[str, jax.Array]


class DiffEqFormer(LanguageModel):
    """The Neural ODE transformer of the paper (``architecture='ode'``)."""

    _architecture = "ode"

    def build_body(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.block = TemporalBlock(config, rngs)

    # ---- the vector field (embed and logits: LanguageModel) -----------------------------------
    def weights_at(self, t: jax.Array | float) -> BlockWeights:
        return self.block.weights(t)

    def vector_field_of(self, positions: jax.Array,
                        segment_ids: jax.Array | None = None) -> VectorField:
        """f(·, t) for one batch, W(t) from the time embedding: what every solve evaluates."""
        return VectorField(self.config, positions, segment_ids, weights_at=self.block.weights)

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
        return self.vector_field_of(positions, segment_ids)(x, t, weights=weights,
                                                            dropout_key=dropout_key)

    # ---- the solves ---------------------------------------------------------------------------
    def solve_fixed(
        self,
        x0: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        num_steps: int | jax.Array | None = None,
        solver: str | None = None,
        max_steps: int | None = None,
        rngs: nnx.Rngs | None = None,
        grid_offset: bool | None = None,
        integrate: tuple[str, ...] = (),
    ) -> tuple[jax.Array, Stats]:
        """(x_N, {"nfe"}) of N steps x_{k+1} = x_k + dt·Σ_i b_i·f(X_i, t_i).

        ``num_steps`` is an int, or a traced int32 with a static ``max_steps`` bound (random
        step counts in training: one compiled program for every N). ``rngs`` (training) draw
        the random grid offset and dropout; None is the deterministic solve.
        ``grid_offset`` (None: ``ModelConfig.random_grid_offset``) draws the random grid
        offset when ``rngs`` are given. ``integrate=("kinetic_energy",)`` (asked for by the
        term that uses it) also integrates ∫ mean(f²) dt (Finlay et al. 2020) beside x by the
        same solver at no extra evaluation, kept per sequence ([B], sharded like the batch,
        so the step holds no cross-device reduction) and averaged over the batch after the
        solve: ``stats["kinetic_energy"]``.
        """
        grid, solver = self._fixed_grid(num_steps, solver, max_steps)
        f, step_inputs, offset = self._grid_field(positions, segment_ids, grid, solver, rngs,
                                                  grid_offset)
        stats = {"nfe": _fixed_nfe(grid, solver)}
        solve = functools.partial(solvers.solve_on_grid, grid=grid, solver=solver,
                                  time_offset=offset, step_inputs=step_inputs,
                                  remat=remat_policy(self.config.remat))
        if "kinetic_energy" not in integrate:
            return solve(f, x0), stats

        def f_and_energy(state, t, *inputs):
            dx = f(state[0], t, *inputs)
            return dx, jnp.mean(jnp.square(dx), axis=(1, 2))

        x, energy = solve(f_and_energy, (x0, jnp.zeros(x0.shape[:1], jnp.float32)))
        return x, {**stats, "kinetic_energy": jnp.mean(energy)}

    def solve_adaptive(
        self,
        x0: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        solver: str | None = None,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> tuple[jax.Array, Stats]:
        """(x(1), {"nfe", "capped"}) by an embedded Runge–Kutta pair with step-size control.

        W(t) is generated at whatever t the controller picks; deterministic, forward only.
        ``solver``: the config's when it is adaptive, else ``'adaptive'`` (bosh3);
        ``rtol``/``atol`` default to the config's.
        """
        cfg = self.config
        if solver is None:
            solver = cfg.solver if solvers.is_adaptive(cfg.solver) else "adaptive"
        if not solvers.is_adaptive(solver):
            raise ValueError(f"solve_adaptive: solver={solver!r}: expected one of "
                             f"{ADAPTIVE_SOLVERS}")
        x, st = solvers.solve_adaptive(
            self.vector_field_of(positions, segment_ids), x0, solver=solver,
            rtol=cfg.rtol if rtol is None else rtol, atol=cfg.atol if atol is None else atol)
        return x, {"nfe": st.nfe, "capped": st.capped}

    def trajectory(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        num_steps: int | None = None,
        solver: str | None = None,
    ) -> jax.Array:
        """Fixed-grid solver states [N+1, B, T, E] (x₀ first), deterministic."""
        positions, segment_ids = default_inputs(tokens, positions, segment_ids)
        grid, solver = self._fixed_grid(num_steps, solver, None)
        f, step_inputs, _ = self._grid_field(positions, segment_ids, grid, solver, None)
        _, states = solvers.solve_on_grid(
            f, self.embeddings(tokens, positions), grid, solver=solver, step_inputs=step_inputs,
            return_trajectory=True, remat=remat_policy(self.config.remat))
        return states

    def body(
        self,
        x0: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        solve: Solve = OWN,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
        return_stats: bool = False,
    ):
        """``__call__``'s ODE solve from x₀: ``solve_adaptive`` for an adaptive solver, else
        ``solve_fixed``, with the training randomness when not ``deterministic``. A setting
        the solver has no use for (N of an adaptive solve, rtol of a fixed grid) is refused."""
        solver = solve.solver or self.config.solver
        if solvers.is_adaptive(solver):
            unused = {"num_steps", "max_steps", "grid_offset", "integrate"} & solve.changes().keys()
            if unused:
                raise ValueError(f"DiffEqFormer: the adaptive solve {solve.describe()} has no "
                                 f"fixed grid for {', '.join(sorted(unused))}")
            x, stats = self.solve_adaptive(x0, positions, segment_ids, solver=solver,
                                           rtol=solve.rtol, atol=solve.atol)
        else:
            unused = {"rtol", "atol"} & solve.changes().keys()
            if unused:
                raise ValueError(f"DiffEqFormer: the fixed-grid solve {solve.describe()} has "
                                 f"no step-size control for {', '.join(sorted(unused))}")
            x, stats = self.solve_fixed(x0, positions, segment_ids, num_steps=solve.num_steps,
                                        solver=solver, max_steps=solve.max_steps,
                                        rngs=self._training_rngs(deterministic, rngs),
                                        grid_offset=solve.grid_offset,
                                        integrate=solve.integrate)
        return (x, stats) if return_stats else x

    # ---- the fixed grid -----------------------------------------------------------------------
    def _fixed_grid(self, num_steps: int | jax.Array | None, solver: str | None,
                    max_steps: int | None) -> tuple[solvers.FixedGrid, str]:
        cfg = self.config
        solver = cfg.solver if solver is None else solver
        if solvers.is_adaptive(solver):
            raise ValueError(f"DiffEqFormer: solver={solver!r} is adaptive: it has no fixed "
                             "grid (use solve_adaptive, or a fixed-grid solver)")
        solvers.check_solver(solver)
        return solvers.FixedGrid(cfg.num_steps if num_steps is None else num_steps,
                                 max_steps), solver

    def _training_rngs(self, deterministic: bool, rngs: nnx.Rngs | None) -> nnx.Rngs | None:
        """The rngs of a training solve (None when deterministic), checked present."""
        if deterministic:
            return None
        cfg = self.config
        if rngs is None and (cfg.dropout_rate > 0 or cfg.random_grid_offset):
            raise ValueError("DiffEqFormer: deterministic=False with dropout_rate > 0 or "
                             "random_grid_offset needs rngs=nnx.Rngs(dropout=...)")
        return rngs

    def _grid_field(self, positions: jax.Array, segment_ids: jax.Array,
                    grid: solvers.FixedGrid, solver: str, rngs: nnx.Rngs | None,
                    grid_offset: bool | None = None,
                    ) -> tuple[Callable, dict | None, jax.Array | float]:
        """(f(x, t[, step_input, stage]), step inputs, time offset): the vector field as the
        grid scan calls it, fed per step with the precomputed W(t_k) and dropout keys.

        Training randomness (``rngs`` given): δ, the random grid offset (one draw per solve,
        see ``_grid_offset``; ``grid_offset`` None: the config's), added to every evaluation
        time, and per-step dropout keys.
        """
        cfg = self.config
        field = self.vector_field_of(positions, segment_ids)
        needs_dropout = rngs is not None and cfg.dropout_rate > 0
        offset_on = cfg.random_grid_offset if grid_offset is None else grid_offset
        needs_offset = rngs is not None and offset_on
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
            w = jax.tree.map(lambda a: a[stage], inp["w"]) if "w" in step_inputs else None
            key = jax.random.fold_in(inp["key"], stage) if needs_dropout else None
            return field(x, t, weights=w, dropout_key=key)

        return f, step_inputs or None, offset

    @staticmethod
    def _grid_offset(grid: solvers.FixedGrid, solver: str, rngs: nnx.Rngs) -> jax.Array:
        """The random grid offset from u ~ U[0, dt), one draw per solve, by the solver's
        tableau (``Tableau.grid_offset``)."""
        u = jax.random.uniform(rngs.dropout(), (), minval=0.0, maxval=grid.dt)
        return solvers.tableau(solver).grid_offset(u, grid.dt)


def _fixed_nfe(grid: solvers.FixedGrid, solver: str) -> jax.Array:
    """Vector-field evaluations of a fixed-grid solve: N · stages."""
    return jnp.asarray(grid.num_steps * solvers.num_stages(solver), jnp.int32)


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
