"""Discrete baselines and the autonomous (weight-shared) ODE ablation."""

import jax
import numpy as np
import pytest
from flax import nnx
from model_helpers import TINY, tiny_config, tiny_model

from ode_lm.models import weights_at
from ode_lm.models.baselines import ParallelLM, SequentialLM
from ode_lm.models.solve import Solve

BASELINE = dict(TINY, num_layers=2)


@pytest.mark.parametrize("arch, flavour, cls", [("sequential", "gpt2", SequentialLM),
                                                ("sequential", "llama", SequentialLM),
                                                ("parallel", "neox", ParallelLM)])
def test_discrete_baselines_shapes_and_causality(arch, flavour, cls):
    model = tiny_model(BASELINE, architecture=arch, flavour=flavour)
    assert isinstance(model, cls)
    x = jax.random.randint(jax.random.key(0), (1, 10), 0, 64)
    y = np.asarray(model(x))
    assert y.shape == (1, 10, 64) and y.dtype == np.float32
    y2 = np.asarray(model(x.at[0, 6].set((x[0, 6] + 1) % 64)))
    np.testing.assert_array_equal(y[0, :6], y2[0, :6])
    assert np.abs(y[0, 6:] - y2[0, 6:]).max() > 0
    assert ("kernel" in vars(model.head) and model.head.kernel is not None) == (flavour != "gpt2")


def test_autonomous_ode_has_constant_weights():
    model = tiny_model(BASELINE, time_dependent=False)
    w0, w1 = weights_at(model, 0.1), weights_at(model, 0.9)
    for k in w0:
        np.testing.assert_array_equal(np.asarray(w0[k]), np.asarray(w1[k]))
    x = jax.random.randint(jax.random.key(0), (1, 8), 0, 64)
    assert np.isfinite(np.asarray(model(x, solve=Solve(None, 3)))).all()


def test_architecture_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="architecture='ode'"):
        ParallelLM(tiny_config(BASELINE), nnx.Rngs(0))


def test_a_discrete_model_refuses_a_solve_it_cannot_run_in_one_line():
    model = tiny_model(BASELINE, architecture="parallel", num_layers=2)
    x = np.zeros((1, 4), np.int32)
    for solve, words in ((Solve("rk4", 2), "'rk4:steps=2'"),
                         (Solve("adaptive", rtol=1e-3), "'adaptive:rtol=0.001'"),
                         (Solve(atol=1e-6), r"Solve\(atol=1e-06\)")):
        with pytest.raises(ValueError, match=f"^ParallelLM: cannot run the solve {words}: a "
                           "discrete model runs its 2 layers"):
            model(x, solve=solve)
