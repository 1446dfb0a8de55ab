"""ODE solvers over [t0, t1]: explicit Runge–Kutta methods given by their Butcher tableaus.

One RK step (``rk_step``) serves every caller: the fixed-grid ``solve`` (a ``lax.scan``),
the adaptive ``solve_adaptive`` (a ``lax.while_loop``), the KV-cached generation and the
Lyapunov step and tangent map. Adding a solver is one ``tableaus.TABLEAUS`` entry.

Fixed grid (``FixedGrid``, its one owner): t_k = t0 + k·dt, dt = (t1 − t0)/N.
- ``euler`` (the paper): x_{k+1} = x_k + dt·f(x_k, t_{k+1}) — the vector field is evaluated
  at the step's *end* time, exactly as the paper's code does (the tableau's c₁ = 1).
- ``midpoint`` (RK2) and ``rk4`` (classic Runge–Kutta 4).
Adaptive (embedded pairs with an error estimate): ``bosh3`` (Bogacki–Shampine 3(2), alias
``adaptive``) and ``dopri5`` (Dormand–Prince 5(4)), both first-same-as-last (FSAL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ode_lm.models.common import remat_policy
from ode_lm.models.tableaus import ADAPTIVE_SOLVERS, ALIASES, SOLVERS, TABLEAUS, Tableau


def tableau(solver: str) -> Tableau:
    return TABLEAUS[ALIASES.get(solver, solver)]


def num_stages(solver: str) -> int:
    """Vector-field evaluations per step (fixed-grid solvers)."""
    check_solver(solver)
    return tableau(solver).stages


def check_solver(solver: str, *, adaptive_ok: bool = False) -> None:
    allowed = SOLVERS + (ADAPTIVE_SOLVERS if adaptive_ok else ())
    if solver not in allowed:
        raise ValueError(f"solver={solver!r}: expected one of {allowed}")


def is_adaptive(solver: str | None) -> bool:
    return solver in ADAPTIVE_SOLVERS


def _TIME_DTYPE():
    """float32, or float64 when x64 is enabled (solver-order tests run in float64)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def _combine(x: Any, dt: Any, coeffs: tuple[float, ...], ks: list) -> Any:
    """x + dt·Σ_j coeffs_j·k_j over pytrees, skipping zero coefficients (no wasted FLOPs).
    Works for jax and numpy leaves alike (the Lyapunov tangent map is float64 numpy)."""
    terms = [(c, k) for c, k in zip(coeffs, ks, strict=False) if c != 0.0]
    if not terms:
        return x

    def leaf(xi, *ki):
        acc = terms[0][0] * ki[0]
        for (c, _), kk in zip(terms[1:], ki[1:], strict=True):
            acc = acc + c * kk
        return (xi + dt * acc).astype(xi.dtype)

    return jax.tree.map(leaf, x, *[k for _, k in terms])


def rk_step(f: Callable, x: Any, t: Any, dt: Any, tab: Tableau, k1: Any = None,
            time_fn: Callable | None = None):
    """One explicit RK step: returns (x_new, stage derivatives [k_1..k_s]).

    ``f(x, t, stage)`` with the python int stage index (callers key per-stage weights or
    KV-cache slots on it). ``k1``, when given, is f(x, t) already known (FSAL reuse).
    ``time_fn(c)``, when given, is the stage time for fraction c (the fixed grid computes
    ``FixedGrid.time``); else t + c·dt."""
    ks: list = []
    for i in range(tab.stages):
        if i == 0 and k1 is not None:
            ks.append(k1)
            continue
        xi = _combine(x, dt, tab.a[i], ks)
        ks.append(f(xi, time_fn(tab.c[i]) if time_fn else t + tab.c[i] * dt, i))
    return _combine(x, dt, tab.b, ks), ks


@dataclasses.dataclass(frozen=True)
class FixedGrid:
    """The fixed time grid t_k = t0 + k·dt, dt = (t1 − t0)/N: its one owner.

    The step-count checks, dt (in the solvers' time dtype for a traced N) and every stage
    time t_k + c·dt live here, so the scan, the model's precomputed weights W(t), its random
    grid offset (drawn in [0, dt)), the KV-cached generation and ``materialize`` all agree.
    ``num_steps``: a python int, or a traced int32 scalar with a static ``max_steps`` bound:
    the scan then runs ``max_steps`` iterations (``length``) and steps k >= N are skipped.
    """

    num_steps: int | jax.Array
    max_steps: int | None = None
    t0: float = 0.0
    t1: float = 1.0

    def __post_init__(self):
        if self.dynamic:
            if not isinstance(self.max_steps, int) or self.max_steps < 1:
                raise ValueError(f"num_steps is traced: it needs a static max_steps >= 1, "
                                 f"got max_steps={self.max_steps!r}")
        elif self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps!r} must be a positive int")

    @property
    def dynamic(self) -> bool:
        """A traced step count (one compiled program for every N ≤ max_steps)."""
        return not isinstance(self.num_steps, int)

    @property
    def length(self) -> int:
        """Scan iterations: N, or the static bound of a traced N."""
        return self.max_steps if self.dynamic else self.num_steps

    @property
    def dt(self) -> jax.Array | float:
        n = jnp.asarray(self.num_steps, _TIME_DTYPE()) if self.dynamic else self.num_steps
        return (self.t1 - self.t0) / n

    def time(self, k: jax.Array, c: Any) -> jax.Array:
        """t0 + (k + c)·dt: the time of the stage at fraction c of step k (no offset)."""
        return self.t0 + (jnp.asarray(k, _TIME_DTYPE()) + c) * self.dt

    def times(self, solver: str) -> jax.Array:
        """[length, stages] times at which the solve evaluates f (without a time offset);
        for a traced N the rows k >= N lie past t1 and are never used."""
        k = jnp.arange(self.length, dtype=_TIME_DTYPE())[:, None]
        return self.time(k, jnp.asarray(tableau(solver).c, _TIME_DTYPE())[None, :])


def solve(
    vector_field: Callable,
    x0: Any,
    *,
    num_steps: int | jax.Array,
    solver: str = "euler",
    t0: float = 0.0,
    t1: float = 1.0,
    max_steps: int | None = None,
    **options,
):
    """``solve_on_grid`` on ``FixedGrid(num_steps, max_steps, t0, t1)``."""
    return solve_on_grid(vector_field, x0, FixedGrid(num_steps, max_steps, t0, t1),
                         solver=solver, **options)


def solve_on_grid(
    vector_field: Callable,
    x0: Any,
    grid: FixedGrid,
    *,
    solver: str = "euler",
    time_offset: jax.Array | float = 0.0,
    step_inputs: Any = None,
    return_trajectory: bool = False,
    remat: str | Callable | None = None,
    unroll: int = 1,
):
    """Integrate dx/dt = f(x, t) over the grid: x_{k+1} = rk_step(x_k, t_k); returns x_N
    (and the [N+1, ...] trajectory).

    vector_field: ``(x, t) -> dx``; when ``step_inputs`` (a pytree with leading axis
      ``grid.length``) is given it is called as ``(x, t, step_input_k, stage)``, which lets
      callers feed precomputed weights or per-step dropout keys.
    time_offset: added to every evaluation time (the randomised grid offset).
    remat: None (no checkpoint), a ``ModelConfig.remat`` name ('none' keeps every named
      activation, 'dots_saveable' the matmul outputs, 'full' only the state; see
      ``common.remat_policy``) or a jax checkpoint policy, applied to each step.
    """
    check_solver(solver)
    tab = tableau(solver)

    def step(x, xs):
        k, inp = xs

        def f(y, t, stage):
            return vector_field(y, t) if inp is None else vector_field(y, t, inp, stage)

        def advance(y):
            return rk_step(f, y, None, grid.dt, tab,
                           time_fn=lambda c: grid.time(k, c) + time_offset)[0]

        x_new = (jax.lax.cond(k < grid.num_steps, advance, lambda y: y, x) if grid.dynamic
                 else advance(x))
        return x_new, (x_new if return_trajectory else None)

    policy = _policy(remat)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    ks = jnp.arange(grid.length, dtype=jnp.int32)
    x_final, traj = jax.lax.scan(step, x0, (ks, step_inputs), unroll=unroll)
    if not return_trajectory:
        return x_final
    traj = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b], axis=0), x0, traj)
    return x_final, traj


def _policy(remat):
    """One remat vocabulary: a name means what ``ModelConfig.remat`` means (common.remat_policy)."""
    if remat is None or callable(remat):
        return remat
    return remat_policy(remat)


ADAPTIVE_MAX_STEPS = 256  # attempted steps before an adaptive solve gives up short of t1


class AdaptiveStats(NamedTuple):
    """What an adaptive solve cost: vector-field evaluations, accepted / rejected steps, and
    ``capped``: it stopped at ``max_steps`` short of t1 (the state is of an unfinished solve)."""

    nfe: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    capped: jax.Array


def _rms(tree: Any) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    total = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
    return jnp.sqrt(total / sum(x.size for x in leaves))


def solve_adaptive(
    vector_field: Callable,
    x0: Any,
    *,
    solver: str = "bosh3",
    rtol: float = 1e-3,
    atol: float = 1e-6,
    t0: float = 0.0,
    t1: float = 1.0,
    first_step: float | None = None,
    max_steps: int = ADAPTIVE_MAX_STEPS,
    safety: float = 0.9,
    min_factor: float = 0.2,
    max_factor: float = 10.0,
) -> tuple[Any, AdaptiveStats]:
    """Integrate dx/dt = f(x, t) with an embedded RK pair and step-size control.

    ``f(x, t)`` is called at whatever t the controller asks for (the DiffEqFormer generates
    W(t) there). The error norm is the RMS over the *whole* state of
    err / (atol + rtol·max(|x|, |x_new|)) (Hairer, Nørsett & Wanner II.4), so one step size
    serves the batch: attention couples the tokens of a sequence at equal t anyway. A step is
    accepted when the norm is ≤ 1; the next h = h·clip(safety·norm^(−1/(q+1)), min, max)
    with q the embedded order. The first step follows Hairer's rule (two extra evaluations)
    unless ``first_step`` is given. ``lax.while_loop``: forward only (evaluation, analysis,
    generation), not differentiable. Stops after ``max_steps`` attempted steps, returning the
    state at the time reached (``capped`` in the stats says so; ``nfe`` counts every
    evaluation); the eval loop warns in one line when any batch was capped.
    """
    check_solver(solver, adaptive_ok=True)
    tab = tableau(solver)
    if tab.b_low is None or not tab.fsal:
        raise ValueError(f"solve_adaptive: solver={solver!r} is not an embedded FSAL pair")
    if not (rtol > 0 and atol >= 0):
        raise ValueError(f"solve_adaptive: rtol={rtol} must be > 0 and atol={atol} >= 0")
    tdt = jnp.float32
    exponent = -1.0 / tab.order  # embedded order q = order - 1 -> -1/(q + 1)
    err_coeffs = tuple(b - bl for b, bl in zip(tab.b, tab.b_low, strict=True))

    def f(x, t, stage=0):
        return vector_field(x, t)

    def scaled_norm(v, x_a, x_b):
        return _rms(jax.tree.map(
            lambda vi, a, b: vi / (atol + rtol * jnp.maximum(jnp.abs(a), jnp.abs(b))),
            v, x_a, x_b))

    f0 = f(x0, jnp.asarray(t0, tdt))
    nfe0 = 1
    if first_step is None:
        d0, d1 = scaled_norm(x0, x0, x0), scaled_norm(f0, x0, x0)
        h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
        h0 = jnp.minimum(h0, t1 - t0)
        x1 = jax.tree.map(lambda a, b: a + h0 * b, x0, f0)
        f1 = f(x1, t0 + h0)
        d2 = scaled_norm(jax.tree.map(jnp.subtract, f1, f0), x0, x0) / h0
        dmax = jnp.maximum(d1, d2)
        h1 = jnp.where(dmax <= 1e-15, jnp.maximum(1e-6, h0 * 1e-3),
                       (0.01 / jnp.maximum(dmax, 1e-15)) ** (1.0 / tab.order))
        h = jnp.minimum(100 * h0, h1)
        nfe0 += 1
    else:
        h = jnp.asarray(first_step, tdt)
    h = jnp.clip(h, 1e-6, t1 - t0).astype(tdt)

    def cond(carry):
        t, _, _, _, _, acc, rej = carry
        return (t < t1) & (acc + rej < max_steps)

    def body(carry):
        t, h, x, k1, nfe, acc, rej = carry
        last = h >= t1 - t
        h_try = jnp.where(last, t1 - t, h)
        x_new, ks = rk_step(f, x, t, h_try, tab, k1=k1)
        err = _combine(jax.tree.map(jnp.zeros_like, x), h_try, err_coeffs, ks)
        norm = scaled_norm(err, x, x_new)
        ok = norm <= 1.0
        factor = jnp.where(norm == 0, max_factor,
                           safety * jnp.maximum(norm, 1e-10) ** exponent)
        factor = jnp.clip(factor, min_factor, jnp.where(ok, max_factor, 1.0))
        pick = lambda a, b: jax.tree.map(lambda u, v: jnp.where(ok, u, v), a, b)
        t_new = jnp.where(ok, jnp.where(last, jnp.asarray(t1, tdt), t + h_try), t)
        # FSAL: the last stage is f(x_new, t + h), the next step's first stage.
        return (t_new, (h_try * factor).astype(tdt), pick(x_new, x), pick(ks[-1], k1),
                nfe + tab.stages - 1, acc + ok.astype(jnp.int32), rej + (~ok).astype(jnp.int32))

    zero = jnp.zeros((), jnp.int32)
    carry = (jnp.asarray(t0, tdt), h, x0, f0, zero + nfe0, zero, zero)
    t, _, x, _, nfe, acc, rej = jax.lax.while_loop(cond, body, carry)
    return x, AdaptiveStats(nfe=nfe, accepted=acc, rejected=rej, capped=t < t1)
