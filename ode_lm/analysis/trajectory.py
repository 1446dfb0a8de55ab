"""Hidden-state trajectories: the state at every solver grid point, or at arbitrary t.

For the ODE model ``trajectory`` runs the model's own solver (``return_trajectory=True``),
so the states are exactly those of a forward pass with that many steps; ``states_at``
integrates segment by segment between requested times, so any t in [0, 1] (off the training
grid too) gets a state. For a discrete baseline the "trajectory" is the residual stream after
each layer, placed at depth t = l / L.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ode_lm.analysis import model_access
from ode_lm.models import solvers


@dataclasses.dataclass
class Trajectory:
    """States ``[P, T, E]`` of one sequence at depths ``times`` ``[P]`` (t=0 is x₀)."""

    times: np.ndarray
    states: np.ndarray
    tokens: np.ndarray
    solver: str
    num_steps: int

    def save(self, path: str | pathlib.Path) -> None:
        np.savez_compressed(path, times=self.times, states=self.states, tokens=self.tokens,
                            solver=np.array(self.solver), num_steps=self.num_steps)


def trajectory(model, tokens: np.ndarray, num_steps: int | None = None,
               solver: str | None = None) -> Trajectory:
    """The hidden state of ``tokens`` (``[T]``) at every grid point of the solve."""
    cfg = model.config
    tokens = model_access.check_tokens(tokens, cfg)
    if not model_access.is_ode(model):
        steps = model_access.num_layers(model)
        if num_steps not in (None, steps) or solver not in (None, "euler"):
            raise ValueError(f"--num_steps={num_steps} / --solver={solver}: a discrete "
                             f"{cfg.architecture} model has exactly {steps} layers (Euler)")
        states = model_access.layer_states(model, tokens)
        return Trajectory(np.arange(steps + 1) / steps, states, tokens, "euler", steps)
    num_steps = cfg.num_steps if num_steps is None else int(num_steps)
    solver = cfg.solver if solver is None else solver
    solvers.check_solver(solver)
    if num_steps < 1:
        raise ValueError(f"--num_steps={num_steps}: must be >= 1")
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, toks):
        return nnx.merge(graphdef, state).trajectory(toks[None], num_steps=num_steps,
                                                     solver=solver)[:, 0]

    states = np.asarray(run(state, jnp.asarray(tokens)))
    return Trajectory(np.arange(num_steps + 1) / num_steps, states, tokens, solver, num_steps)


def states_at(model, tokens: np.ndarray, times, max_dt: float | None = None,
              solver: str | None = None) -> Trajectory:
    """ODE states at arbitrary sorted ``times`` in [0, 1] (t=0 is prepended if missing).

    Each interval between consecutive times is integrated with ceil(Δt / max_dt) steps of
    ``solver`` (default: the model's; max_dt defaults to 1 / config.num_steps).
    """
    cfg = model.config
    if not model_access.is_ode(model):
        raise ValueError(f"states at arbitrary t need the ODE model, not {cfg.architecture!r}")
    tokens = model_access.check_tokens(tokens, cfg)
    times = np.asarray(times, np.float64)
    if times.ndim != 1 or np.any(np.diff(times) < 0) or times.min() < 0 or times.max() > 1:
        raise ValueError(f"--times must be sorted values in [0, 1], got {times.tolist()}")
    if times[0] > 0:
        times = np.concatenate([[0.0], times])
    solver = cfg.solver if solver is None else solver
    solvers.check_solver(solver)
    max_dt = 1.0 / cfg.num_steps if max_dt is None else float(max_dt)
    field, (state,) = model_access.ode_field(model)
    positions = jnp.arange(len(tokens), dtype=jnp.int32)

    def segment(x, state, a, b, n):
        return solvers.solve(lambda y, t: field(y, t, state, positions), x, num_steps=n,
                             solver=solver, t0=a, t1=b)

    seg = jax.jit(segment, static_argnums=(4,))  # one compile per distinct step count
    x = model_access.embed(model, tokens)
    out = [np.asarray(x)]
    total = 0
    for a, b in zip(times[:-1], times[1:], strict=True):
        if b > a:
            n = max(1, math.ceil((b - a) / max_dt - 1e-9))
            total += n
            x = seg(x, state, jnp.float32(a), jnp.float32(b), n)
        out.append(np.asarray(x))
    return Trajectory(times, np.stack(out), tokens, solver, total)
