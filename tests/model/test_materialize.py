"""materialize: the ODE at M Euler steps equals an M-layer parallel-block transformer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import TINY, tiny_config, tiny_model

from ode_lm.models import ModelConfig, build_model
from ode_lm.models.baselines import ParallelLM
from ode_lm.models.materialize import materialize
from ode_lm.models.solve import Solve

THREE = dict(TINY, num_steps=3)


def perturbed(config: ModelConfig, scale: float = 0.05):
    """A model with noise on every parameter, so that every weight (and t) matters."""
    model = build_model(config, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = np.asarray(var[...])
        var[...] = jnp.asarray(v + scale * rng.standard_normal(v.shape), jnp.float32)
    return model


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "neox"])
def test_materialize_matches_ode_at_m_equal_and_unequal_n(flavour):
    model = perturbed(tiny_config(THREE, flavour=flavour))
    x = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)
    odes = {}
    for m in (3, 5):  # M = N (the config default) and M ≠ N
        flat = materialize(model, num_steps=m)
        assert isinstance(flat, ParallelLM) and flat.config.num_layers == m
        odes[m] = np.asarray(model(x, solve=Solve(None, m)))
        dis = np.asarray(flat(x))
        # dt folded into out_*/mlp_out_* (one extra float32 rounding per layer) on logits ~O(1)
        assert np.abs(odes[m] - dis).max() < 1e-5, (flavour, m, np.abs(odes[m] - dis).max())
    # a 1e-5 match means something only if the depth discretisation itself matters more
    assert np.abs(odes[3] - odes[5]).max() > 1e-3


def test_materialize_rejects_bad_arguments():
    model = tiny_model(THREE)
    with pytest.raises(ValueError, match="solver='rk4'"):
        materialize(model, 4, solver="rk4")
    with pytest.raises(ValueError, match="num_steps=0"):
        materialize(model, 0)
    with pytest.raises(TypeError, match="DiffEqFormer"):
        materialize(materialize(model, 2), 2)
