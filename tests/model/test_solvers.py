"""Fixed-grid solvers: convergence order on a smooth toy ODE, trajectories, step inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ode_lm.models import solvers


def toy_field(x, t):
    """A smooth, nonlinear, non-autonomous toy: dx/dt = 2·sin(x) + cos(5t)·x."""
    return 2.0 * jnp.sin(x) + jnp.cos(5.0 * t) * x


@pytest.mark.parametrize("solver, order, steps", [("euler", 1, (64, 128, 256)),
                                                  ("midpoint", 2, (64, 128, 256)),
                                                  ("rk4", 4, (8, 16, 32))])
def test_convergence_order(solver, order, steps):
    """Error ratios when N doubles: ≈2 (Euler), ≈4 (midpoint), ≈16 (RK4); float64 state."""
    with jax.enable_x64(True):
        x0 = jnp.asarray(0.7, jnp.float64)
        truth = float(solvers.solve(toy_field, x0, num_steps=4096, solver="rk4"))
        errs = [abs(float(solvers.solve(toy_field, x0, num_steps=n, solver=solver)) - truth)
                for n in steps]
    ratios = [errs[0] / errs[1], errs[1] / errs[2]]
    for r in ratios:
        assert 0.85 * 2**order < r < 1.15 * 2**order, (solver, errs, ratios)


def test_euler_uses_end_time_and_trajectory():
    seen = []

    def f(x, t):
        seen.append(t)
        return jnp.full_like(x, 1.0) * t

    x, traj = solvers.solve(f, jnp.zeros(()), num_steps=4, solver="euler",
                            return_trajectory=True)
    # x_{k+1} = x_k + dt·t_{k+1}: sum of (k+1)/16 for k=0..3 = 10/16
    assert abs(float(x) - 10 / 16) < 1e-6
    assert traj.shape == (5,) and float(traj[0]) == 0.0
    np.testing.assert_allclose(np.asarray(traj), np.cumsum([0, 1, 2, 3, 4]) / 16, atol=1e-6)
    np.testing.assert_allclose(np.asarray(solvers.FixedGrid(4).times("euler"))[:, 0],
                               [0.25, 0.5, 0.75, 1.0])


def test_step_inputs_and_time_offset():
    def f(x, t, inp, stage):
        return inp * jnp.ones_like(x) + 0.0 * t

    inputs = jnp.arange(4.0)
    x = solvers.solve(f, jnp.zeros(()), num_steps=4, solver="rk4", step_inputs=inputs)
    assert abs(float(x) - float(inputs.sum()) / 4) < 1e-6
    xo = solvers.solve(lambda x, t: t * jnp.ones_like(x), jnp.zeros(()), num_steps=2,
                       time_offset=-0.25)
    assert abs(float(xo) - 0.5 * (0.25 + 0.75)) < 1e-6


def test_pytree_state_and_remat():
    def f(x, t):
        return {"a": -x["a"], "b": x["a"] * t}

    x0 = {"a": jnp.ones(3), "b": jnp.zeros(3)}
    g = jax.grad(lambda a: solvers.solve(f, {"a": a, "b": jnp.zeros(3)}, num_steps=8,
                                         solver="midpoint", remat="full")["b"].sum())
    g_plain = jax.grad(lambda a: solvers.solve(f, {"a": a, "b": jnp.zeros(3)}, num_steps=8,
                                               solver="midpoint")["b"].sum())
    np.testing.assert_allclose(np.asarray(g(x0["a"])), np.asarray(g_plain(x0["a"])), rtol=1e-6)


@pytest.mark.parametrize("kw, msg", [({"solver": "dopri5"}, "solver"),
                                     ({"num_steps": 0}, "num_steps"),
                                     ({"remat": "sometimes"}, "remat")])
def test_bad_arguments(kw, msg):
    args = {"num_steps": 2, **kw}
    with pytest.raises(ValueError, match=msg):
        solvers.solve(toy_field, jnp.zeros(()), **args)


def test_remat_names_mean_what_model_config_remat_means(capsys):
    """One remat vocabulary: solve(remat=name) saves what ModelConfig.remat=name saves
    ('none': every named activation, 'dots_saveable': matmul outputs only, 'full': the state)."""
    from jax.ad_checkpoint import checkpoint_name

    def f(x, t):
        a = checkpoint_name(jnp.sin(x) * t, "norm1_out")  # named, not a matmul output
        b = checkpoint_name(jnp.cos(a), "mlp_pre")  # named matmul output (common.DOT_NAMES)
        return b * x

    saved = {}
    for name in ("none", "dots_saveable", "full"):
        jax.ad_checkpoint.print_saved_residuals(
            lambda x, name=name: solvers.solve(f, x, num_steps=3, remat=name).sum(), jnp.ones(4))
        saved[name] = capsys.readouterr().out.count("output of scan")
    # per step: state + both names / state + mlp_pre / the state alone
    assert saved == {"none": 3, "dots_saveable": 2, "full": 1}, saved
