"""Fixed-grid ODE solvers over [t0, t1] with N steps, as one ``jax.lax.scan``.

Grid: t_k = t0 + k·dt, dt = (t1 − t0)/N.
- ``euler`` (the paper): x_{k+1} = x_k + dt·f(x_k, t_{k+1}) — the vector field is evaluated
  at the step's *end* time, exactly as the paper's code does.
- ``midpoint`` (RK2): x_{k+1} = x_k + dt·f(x_k + dt/2·f(x_k, t_k), t_k + dt/2).
- ``rk4``: classic Runge–Kutta 4.
Midpoint and RK4 go beyond the paper (it names better solvers as future work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ode_lm.models.config import SOLVERS

# Evaluation times of each stage as a fraction of dt from t_k.
STAGE_TIMES: dict[str, tuple[float, ...]] = {
    "euler": (1.0,),
    "midpoint": (0.0, 0.5),
    "rk4": (0.0, 0.5, 0.5, 1.0),
}


def num_stages(solver: str) -> int:
    """Vector-field evaluations per step."""
    check_solver(solver)
    return len(STAGE_TIMES[solver])


def check_solver(solver: str) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r}: expected one of {SOLVERS}")


def _TIME_DTYPE():
    """float32, or float64 when x64 is enabled (solver-order tests run in float64)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def _axpy(a, x, y):
    """y + a·x over pytrees."""
    return jax.tree.map(lambda xi, yi: (yi + a * xi).astype(yi.dtype), x, y)


def solve(
    vector_field: Callable,
    x0: Any,
    *,
    num_steps: int,
    solver: str = "euler",
    t0: float = 0.0,
    t1: float = 1.0,
    time_offset: jax.Array | float = 0.0,
    step_inputs: Any = None,
    return_trajectory: bool = False,
    remat: str | Callable | None = None,
    unroll: int = 1,
):
    """Integrate dx/dt = f(x, t) from t0 to t1; returns x_N (and [N+1, ...] trajectory).

    vector_field: ``(x, t) -> dx``; when ``step_inputs`` (a pytree with leading axis N) is
      given it is called as ``(x, t, step_input_k, stage)`` with the python int stage index,
      which lets callers feed precomputed weights or per-step dropout keys.
    time_offset: added to every evaluation time (the randomised grid offset).
    remat: None/'none' (no checkpoint), 'full', 'dots_saveable', or a jax checkpoint policy
      (callable) applied to each step.
    """
    check_solver(solver)
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"solve: num_steps={num_steps!r} must be a positive int")
    dt = (t1 - t0) / num_steps

    def f(x, t, inp, stage):
        return vector_field(x, t) if inp is None else vector_field(x, t, inp, stage)

    def step(x, xs):
        k, inp = xs
        tk = jnp.asarray(k, _TIME_DTYPE())

        def time(c):
            return t0 + (tk + c) * dt + time_offset

        if solver == "euler":
            x_new = _axpy(dt, f(x, time(1.0), inp, 0), x)
        elif solver == "midpoint":
            k1 = f(x, time(0.0), inp, 0)
            x_new = _axpy(dt, f(_axpy(dt / 2, k1, x), time(0.5), inp, 1), x)
        else:
            k1 = f(x, time(0.0), inp, 0)
            k2 = f(_axpy(dt / 2, k1, x), time(0.5), inp, 1)
            k3 = f(_axpy(dt / 2, k2, x), time(0.5), inp, 2)
            k4 = f(_axpy(dt, k3, x), time(1.0), inp, 3)
            incr = jax.tree.map(lambda a, b, c, d: (a + 2 * b + 2 * c + d) / 6, k1, k2, k3, k4)
            x_new = _axpy(dt, incr, x)
        return x_new, (x_new if return_trajectory else None)

    policy = _policy(remat)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    ks = jnp.arange(num_steps, dtype=jnp.int32)
    x_final, traj = jax.lax.scan(step, x0, (ks, step_inputs), unroll=unroll)
    if not return_trajectory:
        return x_final
    traj = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b], axis=0), x0, traj)
    return x_final, traj


def _policy(remat):
    if remat is None or remat == "none":
        return None
    if callable(remat):
        return remat
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "dots_saveable":
        return jax.checkpoint_policies.dots_saveable
    raise ValueError(f"solve: remat={remat!r}: expected none | full | dots_saveable or a policy")


def evaluation_times(num_steps: int, solver: str, t0: float = 0.0, t1: float = 1.0):
    """[N, stages] float32 times at which ``solve`` evaluates f (without a time offset)."""
    dt = (t1 - t0) / num_steps
    k = jnp.arange(num_steps, dtype=jnp.float32)[:, None]
    c = jnp.asarray(STAGE_TIMES[solver], jnp.float32)[None, :]
    return t0 + (k + c) * dt
