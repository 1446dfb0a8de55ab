"""Continuous depth in the model: the adaptive solvers (tolerance, NFE), one program for every
traced step count (solvers and model), the kinetic-energy statistic and adaptive generation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_helpers
import numpy as np
import pytest
from flax import nnx
from model_helpers import LIVELY, greedy_uncached

from ode_lm.models import ModelConfig, build_model, solvers
from ode_lm.models.config import SOLVERS
from ode_lm.models.solve import Solve


def known_field(x, t):
    """dx/dt = 5·cos(5t)·x, solved by x(t) = x₀·exp(sin 5t): non-autonomous, known."""
    return 5.0 * jnp.cos(5.0 * t) * x


def known_solution(x0, t):
    return x0 * np.exp(np.sin(5.0 * t))


@pytest.mark.parametrize("solver", ["adaptive", "dopri5"])
def test_adaptive_reaches_its_tolerance_and_nfe_falls_with_rtol(solver):
    """float64, so the error is the solver's: global error ≤ 10·rtol (local control
    accumulates over the steps; 10× covers it for these smooth fields)."""
    with jax.enable_x64(True):
        x0 = jnp.asarray([0.5, -1.0, 2.0], jnp.float64)
        truth = known_solution(np.asarray(x0), 1.0)
        nfes = []
        for rtol in (1e-6, 1e-4, 1e-2):
            x, stats = jax.jit(lambda y, r=rtol: solvers.solve_adaptive(
                known_field, y, solver=solver, rtol=r, atol=r * 1e-3))(x0)
            err = np.max(np.abs(np.asarray(x) - truth) / np.abs(truth))
            assert err <= 10 * rtol, (rtol, err)
            assert int(stats.accepted) >= 1 and int(stats.nfe) > 0
            nfes.append(int(stats.nfe))
    assert nfes[0] > nfes[1] > nfes[2], nfes


def test_adaptive_bad_tolerances_and_solver():
    with pytest.raises(ValueError, match="rtol=0"):
        solvers.solve_adaptive(known_field, jnp.ones(2), rtol=0.0)
    with pytest.raises(ValueError, match="solver='rk4'"):
        solvers.solve_adaptive(known_field, jnp.ones(2), solver="rk4")


@pytest.mark.parametrize("solver", SOLVERS)
def test_traced_num_steps_matches_static(solver):
    """One program for every N ≤ max_steps gives the static N-step solve (same ops)."""
    x0 = jnp.linspace(-1.0, 1.0, 4)
    fn = jax.jit(lambda n: solvers.solve(known_field, x0, num_steps=n, solver=solver,
                                         max_steps=7))
    for n in (1, 3, 7):
        static = solvers.solve(known_field, x0, num_steps=n, solver=solver)
        np.testing.assert_allclose(fn(jnp.int32(n)), static, rtol=1e-6, atol=1e-7)


def tiny_config(**kw) -> ModelConfig:
    return model_helpers.tiny_config(LIVELY, max_seq_len=16, **kw)


@pytest.mark.slow
def test_model_traced_steps_and_kinetic_energy():
    model = build_model(tiny_config(), nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    static = model(tokens, solve=Solve(None, 3))
    traced = nnx.jit(lambda m, n: m(tokens, solve=Solve(None, n, max_steps=5)))(model,
                                                                            jnp.int32(3))
    # precompute generates 3 vs 5 weight sets (another contraction shape): float32 sums
    np.testing.assert_allclose(traced, static, rtol=1e-5, atol=1e-5)
    # kinetic energy = Σ_k dt·mean(f(x_k, t_{k+1})²) along the Euler trajectory, integrated
    # only when the solve asks for it, beside the same x
    positions = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
    segments = jnp.ones((2, 16), jnp.int32)
    x0 = model.embed(tokens, positions)
    x_plain, plain = model.body(x0, positions, segments, solve=Solve(None, 3),
                                return_stats=True)
    assert "kinetic_energy" not in plain
    x_energy, stats = model.body(x0, positions, segments, return_stats=True,
                                 solve=Solve(None, 3, integrate=("kinetic_energy",)))
    np.testing.assert_array_equal(np.asarray(x_energy), np.asarray(x_plain))
    traj = model.trajectory(tokens, num_steps=3)
    expected = sum(float(jnp.mean(jnp.square(model.vector_field(traj[k], (k + 1) / 3)))) / 3
                   for k in range(3))
    np.testing.assert_allclose(float(stats["kinetic_energy"]), expected, rtol=1e-5)
    assert int(stats["nfe"]) == 3


@pytest.mark.slow
def test_adaptive_generation_equals_uncached_greedy():
    from ode_lm.generation import generate

    model = build_model(tiny_config(), nnx.Rngs(0))
    out = generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=4, solver="adaptive", rtol=1e-2)
    ref = greedy_uncached(model, [1, 2, 3, 4, 5], 4, solver="adaptive", rtol=1e-2)
    np.testing.assert_array_equal(out[0], ref)
    batch = generate(model, [[1, 2, 3, 4, 5], [7, 8]], max_new_tokens=3, solver="dopri5")
    assert batch.shape == (2, 3) and batch.max() < 64
