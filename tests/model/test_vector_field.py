"""One vector field f(x, t): the fixed-grid solve, the adaptive solve, KV-cached generation and
the analysis all evaluate ``VectorField``, so they agree bit for bit with the public
``DiffEqFormer.vector_field``; and each solve mode is one function with one return shape.

The agreement tests run under ``jax.disable_jit()``: every primitive then executes on its own,
in the same order and on the same shapes on both sides, so the solver states match exactly
(float32, no tolerance) on any machine. Inside one compiled program XLA may fuse and reorder
a reduction differently from another program, which is what a tolerance would have to cover.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import LIVELY, tiny_model

from ode_lm import generation
from ode_lm.analysis import model_access
from ode_lm.models import solvers

B, T = 2, 10


@functools.cache
def model(weight_generation: str = "in_scan", flavour: str = "neox") -> nnx.Module:
    return tiny_model(LIVELY, flavour=flavour, weight_generation=weight_generation)


def packed_inputs():
    """x₀ of two rows, the second packing two documents (the mask must reach every site)."""
    tokens = jax.random.randint(jax.random.key(3), (B, T), 0, LIVELY["vocab_size"])
    segment_ids = jnp.array([[1] * T, [1] * 6 + [2] * 4], jnp.int32)
    positions = jnp.array([list(range(T)), list(range(6)) + list(range(4))], jnp.int32)
    return model().embed(tokens, positions), positions, segment_ids


def stage_weights(m, grid: solvers.FixedGrid, solver: str):
    """W(t) at every stage time of the grid, [N, stages, ...] (generated as one batch)."""
    times = grid.times(solver)
    return jax.tree.map(lambda a: a.reshape(times.shape + a.shape[1:]),
                        m.weights_at(times.reshape(-1)))


@pytest.mark.parametrize("weight_generation,solver", [("in_scan", "midpoint"),
                                                      ("precompute", "euler")])
def test_fixed_grid_solve_steps_the_public_vector_field(weight_generation, solver):
    m = model(weight_generation)
    x0, positions, segment_ids = packed_inputs()
    grid = solvers.FixedGrid(2)
    if weight_generation == "in_scan":  # W(t) generated at each stage's t
        def f(y, t):
            return m.vector_field(y, t, positions, segment_ids)
        inputs = None
    else:  # W(t_k) for the whole grid up front: the public field given those weights
        def f(y, t, w, stage):
            return m.vector_field(y, t, positions, segment_ids,
                                  weights=jax.tree.map(lambda a: a[stage], w))
        inputs = stage_weights(m, grid, solver)
    with jax.disable_jit():
        x, stats = m.solve_fixed(x0, positions, segment_ids, num_steps=2, solver=solver)
        want = solvers.solve_on_grid(f, x0, grid, solver=solver, step_inputs=inputs)
    np.testing.assert_array_equal(x, want)
    assert set(stats) == {"nfe"}  # the kinetic energy only when a term asks for it
    assert int(stats["nfe"]) == 2 * solvers.num_stages(solver)


def test_adaptive_solve_evaluates_the_public_vector_field():
    m = model()
    x0, positions, segment_ids = packed_inputs()
    tol = dict(rtol=0.3, atol=0.1)  # a handful of steps: every evaluation runs eagerly here
    with jax.disable_jit():
        x, stats = m.solve_adaptive(x0, positions, segment_ids, solver="bosh3", **tol)
        want, st = solvers.solve_adaptive(
            lambda y, t: m.vector_field(y, t, positions, segment_ids), x0, solver="bosh3",
            **tol)
    np.testing.assert_array_equal(x, want)
    assert set(stats) == {"nfe", "capped"}
    assert int(stats["nfe"]) == int(st.nfe) > 4 and not bool(stats["capped"])


def test_fixed_adaptive_and_analysis_fields_are_the_public_one_at_any_x_t(monkeypatch):
    """The callables the solves hand to the generic solvers, evaluated off their path."""
    m = model()
    x0, positions, segment_ids = packed_inputs()
    handed = {}

    def capture(name, solve):
        def wrapped(vector_field, *args, **kwargs):
            handed[name] = vector_field
            return solve(vector_field, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(solvers, "solve_on_grid", capture("fixed", solvers.solve_on_grid))
    monkeypatch.setattr(solvers, "solve_adaptive", capture("adaptive", solvers.solve_adaptive))
    m.solve_fixed(x0, positions, segment_ids, num_steps=2, solver="rk4")
    m.solve_adaptive(x0, positions, segment_ids, rtol=0.3, atol=0.1)
    field, args = model_access.ode_field(m)
    x = x0 + 0.1 * jax.random.normal(jax.random.key(4), x0.shape)
    for t in (0.0, 0.37, 1.0):  # on and off the grid: the same f(x, t) at every site
        public = m.vector_field(x, t, positions, segment_ids)
        np.testing.assert_array_equal(handed["fixed"](x, t), public)
        np.testing.assert_array_equal(handed["adaptive"](x, t), public)
        # analysis: one sequence (one segment)
        alone = m.vector_field(x[:1], t, positions[:1])
        np.testing.assert_array_equal(field(x[0], t, *args, positions[0]), alone[0])


def test_cached_generation_evaluates_the_public_vector_field():
    """Generation's prefill through the KV cache (as wide as the prompt) steps f exactly as
    the fixed grid does, at generation's own pre-generated stage weights."""
    m = model()
    x0 = packed_inputs()[0]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    weights, dt, solver = generation.stage_weights(m, 2, "midpoint")
    cache = generation.init_cache(m.config, 2, solvers.num_stages(solver), B, T)

    def f(y, t, w, stage):
        return m.vector_field(y, t, positions, weights=jax.tree.map(lambda a: a[stage], w))

    with jax.disable_jit():
        x, _ = generation.solve_cached(m.config, weights, dt, solver, x0, positions, 0, cache,
                                       jnp.ones((B, T), bool))
        want = solvers.solve_on_grid(f, x0, solvers.FixedGrid(2), solver=solver,
                                     step_inputs=weights)
    np.testing.assert_array_equal(x, want)


def test_trajectory_is_the_fixed_solve_state_by_state():
    m = model()
    tokens = jax.random.randint(jax.random.key(5), (B, T), 0, LIVELY["vocab_size"])
    with jax.disable_jit():
        states = m.trajectory(tokens, num_steps=2, solver="euler")
        x0 = m.embed(tokens)
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        segment_ids = jnp.ones((B, T), jnp.int32)
        x, _ = m.solve_fixed(x0, positions, segment_ids, num_steps=2, solver="euler")
    assert states.shape == (3, B, T, m.config.d_model)
    np.testing.assert_array_equal(states[0], x0)
    np.testing.assert_array_equal(states[-1], x)


def test_each_mode_rejects_the_other_modes_solvers():
    m = model()
    x0, positions, segment_ids = packed_inputs()
    with pytest.raises(ValueError, match="no fixed grid"):
        m.solve_fixed(x0, positions, segment_ids, solver="adaptive")
    with pytest.raises(ValueError, match="no fixed grid"):
        m.trajectory(jnp.zeros((1, 4), jnp.int32), solver="dopri5")
    with pytest.raises(ValueError, match="solve_adaptive: solver='rk4'"):
        m.solve_adaptive(x0, positions, segment_ids, solver="rk4")
    with pytest.raises(ValueError, match="solver='rk45'"):
        m.solve_fixed(x0, positions, segment_ids, solver="rk45")
