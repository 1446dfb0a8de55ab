"""Correctness of the Benettin QR Lyapunov exponents on fields with known answers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import f32_atol

from ode_lm.analysis.lyapunov import jacobian_row, lyapunov_exponents


def _linear_field(a: np.ndarray):
    a32 = jnp.asarray(a, jnp.float32)
    return lambda x, t: x @ a32.T  # f(x) = A x for every token (row-vector convention)


def _stability(solver: str, z: np.ndarray) -> np.ndarray:
    """The solver's amplification factor R(dt λ) on the linear test equation."""
    poly = {"euler": [1, 1], "midpoint": [1, 1, 1 / 2], "rk4": [1, 1, 1 / 2, 1 / 6, 1 / 24]}
    return sum(c * z**p for p, c in enumerate(poly[solver]))


@pytest.mark.parametrize("solver", ["euler", "midpoint", "rk4"])
def test_triangular_linear_field_is_exact_at_few_steps(solver):
    # Upper-triangular A: the tangent map stays triangular, QR is trivial, and the exponents
    # are exactly log|R(dt a_ii)| / dt at any number of steps, e.g. the 6 of cpu_small.
    rng = np.random.default_rng(0)
    a = np.triu(rng.normal(size=(5, 5)))
    a = np.asarray(a.astype(np.float32), np.float64)
    res = lyapunov_exponents(_linear_field(a), jnp.ones((1, 5)), num_steps=6, solver=solver)
    dt = 1 / 6
    expected = np.sort(np.log(np.abs(_stability(solver, dt * np.diag(a)))) / dt)[::-1]
    # 1e-9 follows from float64, not float32: A is float32-representable, the VJPs of the
    # linear field against one-hot rows return A's entries exactly (every other product is 0),
    # and the tangent map, QR and logs run on the host in float64 (lyapunov.py).
    np.testing.assert_allclose(res.exponents[0], expected, rtol=0, atol=1e-9)


def test_general_linear_field_matches_real_parts_of_eigenvalues():
    # A = U·blockdiag(rotation-scaling, reals)·Uᵀ has a complex pair a ± ib; over a long
    # horizon the Euler exponents converge to log|1 + dt·λ| / dt (the Euler map's exact
    # exponents), which in turn differ from Re λ by O(dt).
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    core = np.zeros((4, 4))
    core[:2, :2] = [[0.3, 1.5], [-1.5, 0.3]]
    core[2, 2], core[3, 3] = -0.8, -2.0
    a = np.asarray((u @ core @ u.T).astype(np.float32), np.float64)
    lam = np.linalg.eigvals(a)
    dt, t1 = 0.02, 200.0
    res = lyapunov_exponents(_linear_field(a), jnp.ones((1, 4)), num_steps=int(t1 / dt),
                             t1=t1, chunk_size=None)
    euler_exact = np.sort(np.log(np.abs(1 + dt * lam)) / dt)[::-1]
    np.testing.assert_allclose(res.exponents[0], euler_exact, atol=0.02)
    # and the continuous-time answer, Re λ, within the Euler discretisation error
    disc = np.abs(euler_exact - np.sort(lam.real)[::-1]).max()
    assert disc < 0.1
    np.testing.assert_allclose(res.exponents[0], np.sort(lam.real)[::-1], atol=0.02 + disc)


def _tanh_mixing_field(w, b, v, c):
    """f_j = tanh(W x_j + b) + c/(j+1) Σ_{i≤j} tanh(V x_i): causal, nonlinear, known Jacobian."""
    w, b, v = (jnp.asarray(z, jnp.float32) for z in (w, b, v))

    def field(x, t):
        n = x.shape[0]
        own = jnp.tanh(x @ w.T + b)
        mixed = jnp.cumsum(jnp.tanh(x @ v.T), axis=0) / jnp.arange(1, n + 1)[:, None]
        return own + c * mixed

    return field


def _reference_exponents(x0, w, b, v, c, j, steps):
    """Float64 numpy Benettin with the hand-derived Jacobian blocks of the field above."""
    x = x0.astype(np.float64)
    n, d = x.shape
    dt = 1 / steps
    q = np.broadcast_to(np.eye(d), (n, d, d)).copy()
    logs = np.zeros((n, d))
    for _ in range(steps):
        jac = np.zeros((n, d, d))
        sv = 1 - np.tanh(x @ v.T) ** 2  # [n, d]
        for i in range(j + 1):
            jac[i] = c / (j + 1) * sv[i][:, None] * v
        jac[j] += (1 - np.tanh(w @ x[j] + b) ** 2)[:, None] * w
        f = np.tanh(x @ w.T + b) + c * np.cumsum(np.tanh(x @ v.T), 0) / np.arange(1, n + 1)[:, None]
        x = x + dt * f
        q, r = np.linalg.qr(q + dt * jac @ q)
        logs += np.log(np.abs(np.diagonal(r, axis1=1, axis2=2)))
    return -np.sort(-logs, axis=-1)


def test_nonlinear_field_matches_hand_derived_jacobian():
    rng = np.random.default_rng(2)
    d, n, j = 6, 5, 3
    w, v = 1.5 * rng.normal(size=(d, d)), rng.normal(size=(d, d))
    b, c = rng.normal(size=d), 0.7
    w, v, b = (np.asarray(z.astype(np.float32), np.float64) for z in (w, v, b))
    x0 = rng.normal(size=(n, d)).astype(np.float32)
    field = _tanh_mixing_field(w, b, v, c)
    res = lyapunov_exponents(field, jnp.asarray(x0), position=j, num_steps=8)
    ref = _reference_exponents(x0, w, b, v, c, j, 8)
    np.testing.assert_allclose(res.exponents, ref, atol=1e-4)
    assert np.abs(res.exponents[: j + 1]).max() > 0.1  # the test is not trivially zero
    assert np.all(res.exponents[j + 1:] == 0.0)


def _causal_attention_field(d, heads, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    wqkv = jax.random.normal(keys[0], (d, 3, heads, d // heads)) / np.sqrt(d)
    wo = jax.random.normal(keys[1], (heads, d // heads, d)) / np.sqrt(d)
    w1 = jax.random.normal(keys[2], (d, d)) / np.sqrt(d)

    def field(x, t):
        q, k, v = jnp.einsum("td,dchk->cthk", x, wqkv * (1 + t))
        attn = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        return jnp.einsum("thk,hkd->td", attn, wo) + jnp.tanh(x @ w1)

    return field


def test_tokens_after_position_get_exactly_zero_influence():
    field = _causal_attention_field(8, 2)
    x0 = jax.random.normal(jax.random.PRNGKey(3), (7, 8))
    j = 4
    rows = np.asarray(jax.jit(lambda x: jacobian_row(field, x, 0.5, j))(x0))
    assert np.all(rows[j + 1:] == 0.0) and np.abs(rows[: j + 1]).max() > 0
    for solver in ("euler", "midpoint"):
        res = lyapunov_exponents(field, x0, position=j, num_steps=2, solver=solver)
        assert np.all(res.exponents[j + 1:] == 0.0)
        assert np.all(np.abs(res.exponents[: j + 1]).max(axis=-1) > 0)
    top = res.top_tokens(3)
    assert all(i <= j for i, _ in top)


def test_jacobian_row_matches_full_jacobian():
    field = _causal_attention_field(8, 2, seed=5)
    x0 = jax.random.normal(jax.random.PRNGKey(4), (6, 8))
    full = jax.jacobian(lambda x: field(x, 0.3)[5])(x0)  # [d_out, T, d_in]
    rows = jax.jit(lambda x: jacobian_row(field, x, 0.3, 5, chunk_size=3))(x0)
    # two float32 reverse passes that may reassociate the same sums: a few ulps of the entries
    np.testing.assert_allclose(np.asarray(rows), np.swapaxes(np.asarray(full), 0, 1), rtol=0,
                               atol=f32_atol(full, 32))


def test_num_exponents_subset_is_the_leading_part():
    field = _causal_attention_field(8, 2, seed=7)
    x0 = jax.random.normal(jax.random.PRNGKey(5), (5, 8))
    full = lyapunov_exponents(field, x0, num_steps=3)
    top2 = lyapunov_exponents(field, x0, num_steps=3, num_exponents=2)
    # QR works column by column, so the first k Benettin vectors (and their log|R_ii|) are
    # the same whatever k is: the k exponents are a subset of the full spectrum. Same device
    # Jacobians on both sides and float64 QR on the host, hence a float64-sized atol.
    for row_k, row_full in zip(top2.exponents, full.exponents, strict=False):
        assert all(np.isclose(row_full, e, atol=1e-9).any() for e in row_k)
    assert top2.exponents.shape == (5, 2)
    assert np.all(top2.max_exponent <= full.max_exponent + 1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(position=9), "--position=9"),
        (dict(solver="heun"), "--solver='heun'"),
        (dict(num_steps=0), "--num_steps=0"),
        (dict(num_exponents=99), "--num_exponents=99"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        lyapunov_exponents(_linear_field(np.eye(3)), jnp.ones((4, 3)), **kwargs)


def test_split_into_mixing_and_local_parts_gives_the_same_exponents():
    rng = np.random.default_rng(6)
    d, n = 5, 4
    w, v = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    b, c = rng.normal(size=d), 0.7
    field = _tanh_mixing_field(w, b, v, c)
    w32, b32, v32 = (jnp.asarray(z, jnp.float32) for z in (w, b, v))

    def mixing(x, t):
        return c * jnp.cumsum(jnp.tanh(x @ v32.T), axis=0) / jnp.arange(1, n + 1)[:, None]

    def local(y, t):  # one token [d]
        return jnp.tanh(w32 @ y + b32)

    x0 = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    whole = lyapunov_exponents(field, x0, position=2, num_steps=3, solver="midpoint")
    split = lyapunov_exponents(field, x0, position=2, num_steps=3, solver="midpoint",
                               split=(mixing, local))
    np.testing.assert_allclose(split.exponents, whole.exponents, atol=1e-5)
