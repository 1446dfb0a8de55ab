"""DiffEqFormer forward: shapes/dtypes, causality, packed sequences, bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import TINY, tiny_model
from numerics import dot_bound

from ode_lm.models import ModelConfig
from ode_lm.models.solve import Solve


@functools.cache
def cached_model(flavour: str):
    """One tiny model per flavour for the whole file (building it dominates these tests)."""
    return tiny_model(flavour=flavour)


@nnx.jit(static_argnames=("num_steps", "solver"))
def forward(model, tokens, positions=None, segment_ids=None, num_steps=None, solver=None):
    return model(tokens, positions, segment_ids, solve=Solve(solver, num_steps))


def tokens(b=2, t=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, TINY["vocab_size"])


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "neox"])
def test_shapes_dtypes_every_solver(flavour):
    model = cached_model(flavour)
    x = tokens()
    outs = {}
    for solver in ("euler", "midpoint", "rk4"):
        y = forward(model, x, solver=solver)
        assert y.shape == (2, 12, 64) and y.dtype == jnp.float32
        assert np.isfinite(np.asarray(y)).all()
        outs[solver] = np.asarray(y)
    # different integrators of the same ODE: not identical, and the order-2 midpoint rule lies
    # nearer the order-4 solution than the order-1 Euler step does
    assert not np.array_equal(outs["euler"], outs["rk4"])
    err_midpoint = np.abs(outs["midpoint"] - outs["rk4"]).max()
    assert err_midpoint < np.abs(outs["euler"] - outs["rk4"]).max()


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_causality(flavour):
    model = cached_model(flavour)
    x = tokens(b=1, t=12)
    j = 7
    x2 = x.at[0, j].set((x[0, j] + 1) % TINY["vocab_size"])
    y1, y2 = np.asarray(forward(model, x)), np.asarray(forward(model, x2))
    np.testing.assert_array_equal(y1[0, :j], y2[0, :j])
    assert np.abs(y1[0, j:] - y2[0, j:]).max() > 1e-6


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "neox"])
def test_packed_row_equals_documents_alone(flavour):
    model = cached_model(flavour)
    doc_a, doc_b = tokens(b=1, t=5, seed=1), tokens(b=1, t=7, seed=2)
    packed = jnp.concatenate([doc_a, doc_b, jnp.zeros((1, 2), jnp.int32)], axis=1)
    seg = jnp.asarray([[1] * 5 + [2] * 7 + [0] * 2])
    pos = jnp.asarray([list(range(5)) + list(range(7)) + [0, 0]])
    y = np.asarray(forward(model, packed, pos, seg))
    ya, yb = np.asarray(forward(model, doc_a)), np.asarray(forward(model, doc_b))
    np.testing.assert_allclose(y[0, :5], ya[0], atol=2e-5)
    np.testing.assert_allclose(y[0, 5:12], yb[0], atol=2e-5)


def test_num_steps_per_call_changes_the_solve():
    model = cached_model("gpt2")
    x = tokens()
    y2, y8 = forward(model, x, num_steps=2), forward(model, x, num_steps=8)
    assert y2.shape == y8.shape
    assert np.abs(np.asarray(y2) - np.asarray(y8)).max() > 1e-6
    np.testing.assert_array_equal(np.asarray(forward(model, x)), np.asarray(y2))  # default N=2


@pytest.mark.parametrize(
    "kw, msg",
    [({"dtype": "float16"}, "dtype"), ({"remat": "some"}, "remat"),
     ({"weight_generation": "lazy"}, "weight_generation"), ({"rotary_fraction": 0.0}, "rotary"),
     ({"time_embed_dim": 0}, "time_embed_dim")],
)
def test_bad_config_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**kw)


def test_bad_call_arguments():
    model = cached_model("gpt2")
    with pytest.raises(ValueError, match="solver='rk45'"):
        model(tokens(), solve=Solve("rk45"))
    with pytest.raises(ValueError, match="num_steps=0"):
        model(tokens(), solve=Solve(num_steps=0))
    # a setting the solver has no use for is refused, in one line naming the solve
    with pytest.raises(ValueError, match="^DiffEqFormer: the fixed-grid solve 'rk4:steps=2' "
                       "has no step-size control for rtol$"):
        model(tokens(), solve=Solve("rk4", 2, rtol=1e-3))
    with pytest.raises(ValueError, match="^DiffEqFormer: the adaptive solve .* has no fixed "
                       "grid for num_steps$"):
        model(tokens(), solve=Solve("adaptive", 4, rtol=1e-3))
    with pytest.raises(ValueError, match=r"tokens: expected shape \[B, T\]"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens(), segment_ids=jnp.ones((2, 3), jnp.int32))


@pytest.mark.parametrize("k_shape", [(), (5,), (2, 3)])
def test_generate_kernel_vjp_matches_autodiff(k_shape):
    """The hand-written backward of W = W0 + g·A (used by every ODE model) equals autodiff."""
    from ode_lm.models.temporal import generate_kernel

    keys = jax.random.split(jax.random.key(0), 4)
    g = jax.random.normal(keys[0], k_shape + (4,))
    w0 = jax.random.normal(keys[1], (3, 2, 5))
    a = jax.random.normal(keys[2], (4, 3, 2, 5))
    ct = jax.random.normal(keys[3], k_shape + (3, 2, 5))
    plain = lambda g, w0, a: w0 + jnp.tensordot(g, a, axes=1)
    out, vjp = jax.vjp(generate_kernel, g, w0, a)
    ref_out, ref_vjp = jax.vjp(plain, g, w0, a)
    # The tolerance is the float32 rounding bound of these sums (at most 30 terms each), from
    # the same computation on |inputs|: sums of |terms| (the bilinear map is exact on them).
    abs_in = [jnp.abs(x) for x in (g, w0, a)]
    abs_out, abs_vjp = jax.vjp(plain, *abs_in)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=dot_bound(abs_out, 30).max())
    for got, want, bound in zip(vjp(ct), ref_vjp(ct), abs_vjp(jnp.abs(ct)), strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_less(np.abs(got - want), dot_bound(bound, 30) + 1e-30)
