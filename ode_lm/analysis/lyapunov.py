"""Token-level Lyapunov exponents of the next-token prediction (Benettin's QR method).

For an output position j and every input token i we follow the linear variational equation

    dQ_i/dt = J_ji(t) · Q_i,      J_ji(t) = ∂f(X(t), t)_j / ∂x_i      (a d × d block),

along the model's own trajectory X(t), integrate it with the *same solver* as the forward
pass (its tangent map: for Euler Q ← Q + dt·J·Q, for midpoint / RK4 the matching stages at
the solver's stage states), re-orthonormalise with a QR decomposition after every step and
accumulate log|diag R|. Dividing by the length of the time interval gives a spectrum of
exponents per input token; its maximum (and its sum) scores how strongly that token can
stretch perturbations of the prediction at j. By causality J_ji ≡ 0 for i > j, so those
tokens get exactly zero exponents (Q never moves, R = I).

**Why reverse mode (VJP) and not JVPs.** The quantity needed per stage is the whole block
row J_j,: = ∂f_j/∂X, a (d) × (T·d) matrix. Its output side (d, one token) is T times smaller
than its input side (T·d), so d vector-Jacobian products, vmapped over the rows of the
identity, give the entire row after *one* linearisation of f. Forward mode would need one
JVP per input direction of every token (T·d JVPs, or T·k for k exponents): a JVP whose
tangent touches several tokens returns Σ_i J_ji v_i, so tokens cannot share a JVP. For the
cpu_small model (d=256, T=128) that is 256 VJPs against 32 768 JVPs per stage. The VJPs are
chunked with ``lax.map(batch_size=...)`` to bound memory. The tangent update and the QR
factorisations run on the host in float64 (numpy, batched over tokens), so long horizons do
not lose precision in the accumulated logs.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ode_lm.analysis.blas import single_threaded
from ode_lm.models import solvers
from ode_lm.models.config import SOLVERS

VectorField = Callable[[jax.Array, jax.Array], jax.Array]


def jacobian_row(field: VectorField, x: jax.Array, t, position: int,
                 chunk_size: int | None = None) -> jax.Array:
    """J[i] = ∂field(x, t)[position] / ∂x[i] for every token i: ``[T, d, d]`` (out, in).

    ``x``: ``[T, d]``. Reverse mode: one linearisation, then d VJPs (one per output unit).
    """
    _, pullback = jax.vjp(lambda y: field(y, t)[position], x)
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    rows = jax.lax.map(lambda e: pullback(e)[0], eye, batch_size=chunk_size)  # [d_out, T, d_in]
    return jnp.swapaxes(rows, 0, 1)


def _solver_step(field: Callable, solver: str, position: int, chunk_size: int | None,
                 split: tuple[Callable, Callable] | None = None):
    """A jitted step: (x_k, t_k, dt, args) -> (x_{k+1}, stage Jacobian rows ``[S, T, d, d]``).

    The step is the model solvers' own ``rk_step`` on the solver's tableau (Euler evaluates
    the field at the step's *end* time t_k + dt, the paper's convention), and the Jacobian
    rows are taken at the stage states and times it visits. With ``split = (mixing, local)``
    the Jacobian row is that of the mixing part plus the single-token Jacobian of the local
    part, added to the block of ``position``.
    """
    tab = solvers.tableau(solver)

    def step(x, t, dt, args):
        def f(y, s):
            return field(y, s, *args)

        def jac(y, s):
            if split is None:
                return jacobian_row(f, y, s, position, chunk_size)
            mixing, local = split
            rows = jacobian_row(lambda z, r: mixing(z, r, *args), y, s, position, chunk_size)
            own = jax.jacfwd(lambda v: local(v, s, *args))(y[position])
            return rows.at[position].add(own)

        stages = []  # (state, time) of every stage, in order

        def stage_field(y, s, _stage):
            stages.append((y, s))
            return f(y, s)

        new, _ = solvers.rk_step(stage_field, x, t, dt, tab)
        return new, jnp.stack([jac(y, s) for y, s in stages])

    return jax.jit(step)


def tangent_step(q: np.ndarray, jacs: np.ndarray, dt: float, solver: str) -> np.ndarray:
    """The solver's tangent map applied to Q (float64, batched over tokens).

    ``q``: ``[T, d, k]``; ``jacs``: ``[S, T, d, d]`` stage Jacobians. Returns the new Q before
    re-orthonormalisation.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r}: expected one of {SOLVERS}")
    # the tangent ODE dq/dt = J(t)·q, stepped with the solver's own tableau
    q_new, _ = solvers.rk_step(lambda y, _t, s: jacs[s] @ y, q, None, dt,
                               solvers.tableau(solver), time_fn=lambda c: c)
    return q_new


def qr_positive(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Batched reduced QR with log|diag R| (the sign of R's diagonal does not matter here)."""
    q, r = np.linalg.qr(m)
    return q, np.log(np.abs(np.diagonal(r, axis1=-2, axis2=-1)))


@dataclasses.dataclass
class LyapunovResult:
    """Exponents ``[T, k]`` (descending per token) for output ``position`` over [t0, t1]."""

    exponents: np.ndarray
    position: int
    solver: str
    num_steps: int
    t0: float = 0.0
    t1: float = 1.0
    tokens: np.ndarray | None = None
    token_text: list[str] | None = None

    @property
    def max_exponent(self) -> np.ndarray:
        """The token score: the largest exponent of each input token, ``[T]``."""
        return self.exponents.max(axis=-1)

    @property
    def sum_exponent(self) -> np.ndarray:
        """Sum of each token's exponents (log volume growth rate), ``[T]``."""
        return self.exponents.sum(axis=-1)

    def score(self, kind: str = "max") -> np.ndarray:
        if kind not in ("max", "sum"):
            raise ValueError(f"--score={kind!r}: expected 'max' or 'sum'")
        return self.max_exponent if kind == "max" else self.sum_exponent

    def top_tokens(self, k: int = 5, kind: str = "max") -> list[tuple[int, float]]:
        """The k most sensitive input positions (index, score), highest score first."""
        s = self.score(kind)
        order = np.argsort(-s, kind="stable")[:k]
        return [(int(i), float(s[i])) for i in order]

    def save(self, path: str | pathlib.Path) -> None:
        out = dict(exponents=self.exponents, max_exponent=self.max_exponent,
                   sum_exponent=self.sum_exponent, position=self.position,
                   solver=np.array(self.solver), num_steps=self.num_steps,
                   t0=self.t0, t1=self.t1)
        if self.tokens is not None:
            out["tokens"] = np.asarray(self.tokens)
        if self.token_text is not None:
            out["token_text"] = np.array(self.token_text, dtype=object).astype(str)
        np.savez_compressed(path, **out)


def lyapunov_exponents(
    field: VectorField,
    x0: jax.Array,
    *,
    position: int = -1,
    num_steps: int = 12,
    solver: str = "euler",
    num_exponents: int | None = None,
    t0: float = 0.0,
    t1: float = 1.0,
    chunk_size: int | None = 64,
    field_args: tuple = (),
    split: tuple[Callable, Callable] | None = None,
) -> LyapunovResult:
    """Benettin QR Lyapunov spectra of output ``position`` w.r.t. every input token.

    ``field(x, t)`` maps ``[T, d]`` to ``[T, d]`` (one sequence, no batch axis); ``x0`` is the
    initial state (the token embeddings). ``field_args`` (e.g. model parameters) are passed
    as ``field(x, t, *field_args)`` and traced as jit arguments rather than baked-in
    constants. ``chunk_size`` bounds how many VJPs run at once.

    ``split = (mixing, local)`` optionally declares field(x, t) = mixing(x, t) + local(x_i, t)
    row by row, with ``local`` acting on one token ``[d]`` (the MLP branch of a parallel
    block). The Jacobians then skip the backward pass of the per-token work at every other
    position: the VJPs only traverse the mixing part (for cpu_small ~3.5x fewer FLOPs). The
    trajectory always uses ``field``. Integrates x and the
    per-token tangent maps on a uniform grid of ``num_steps`` steps over [t0, t1] and
    returns exponents ``[T, k]`` with k = ``num_exponents`` (default d).
    """
    if solver not in SOLVERS:
        raise ValueError(f"--solver={solver!r}: expected one of {SOLVERS}")
    if num_steps <= 0:
        raise ValueError(f"--num_steps={num_steps}: must be >= 1")
    if not t1 > t0:
        raise ValueError(f"time interval [{t0}, {t1}] is empty")
    x = jnp.asarray(x0)
    if x.ndim != 2:
        raise ValueError(f"lyapunov_exponents: x0 must be [T, d], got shape {x.shape}")
    num_tokens, d = x.shape
    if not -num_tokens <= position < num_tokens:
        raise ValueError(f"--position={position} is outside the {num_tokens}-token text")
    position %= num_tokens
    k = d if num_exponents is None else int(num_exponents)
    if not 1 <= k <= d:
        raise ValueError(f"--num_exponents={num_exponents}: must be in [1, {d}]")

    step = _solver_step(field, solver, position, chunk_size, split)
    dt = (t1 - t0) / num_steps
    q = np.broadcast_to(np.eye(d, k), (num_tokens, d, k)).copy()
    logs = np.zeros((num_tokens, k))
    for n in range(num_steps):
        t = jnp.asarray(t0 + n * dt, dtype=x.dtype)
        x, jacs = step(x, t, jnp.asarray(dt, dtype=x.dtype), field_args)
        jacs = np.asarray(jacs, dtype=np.float64)
        with single_threaded():  # see blas.py: OpenBLAS threads cost ~30x more CPU here
            q, log_r = qr_positive(tangent_step(q, jacs, dt, solver))
        logs += log_r
    exponents = -np.sort(-logs / (t1 - t0), axis=-1)
    return LyapunovResult(exponents=exponents, position=position, solver=solver,
                          num_steps=num_steps, t0=t0, t1=t1)
