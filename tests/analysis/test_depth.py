"""Depth in training and analysis: the train step's random step counts and its depth settings
(StepConfig), and the W(t) smoothness figure. The model's continuous depth is in
tests/model/test_continuous_depth.py; ode-lm eval and depth-report in
tests/cli/test_eval_depth_cli.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_helpers
import numpy as np
import optax
import pytest
from flax import nnx
from model_helpers import LIVELY

from ode_lm import partitioning
from ode_lm.models import ModelConfig, build_model
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib


def tiny_config(**kw) -> ModelConfig:
    return model_helpers.tiny_config(LIVELY, max_seq_len=16, **kw)


def _spec(cfg: ModelConfig):
    mesh = partitioning.create_mesh((1, 1, 1), devices=jax.devices()[:1])
    return state_lib.build_state_spec(lambda rngs: build_model(cfg, rngs), optax.adam(1e-3),
                                      mesh, partitioning.axis_rules())


def _batch(seed: int = 0):
    x = np.random.default_rng(seed).integers(0, 64, (4, 17)).astype(np.int32)
    return {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": np.ones((4, 16), np.int32),
            "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
            "loss_mask": np.ones((4, 16), np.float32)}


def _run_steps(spec, config, seed, steps=6):
    fn = step_lib.jit_train_step(spec, optax.constant_schedule(1e-3), config)
    state = state_lib.init_state(spec, seed)
    ns, losses = [], []
    with jax.set_mesh(spec.mesh):
        for i in range(steps):
            state, m = fn(state, _batch(i))
            ns.append(int(m["num_steps"]))
            losses.append(float(m["loss"]))
            assert float(m["kinetic_energy"]) > 0
    return ns, losses, state


@pytest.mark.slow
def test_random_step_counts_are_seeded_and_drawn_from_the_set():
    spec = _spec(tiny_config(random_grid_offset=True))
    config = step_lib.StepConfig(num_steps_choices=(1, 2, 4), kinetic_energy_weight=0.1,
                                 dropout=True)
    ns, losses, state = _run_steps(spec, config, seed=0)
    ns2, losses2, state2 = _run_steps(spec, config, seed=0)
    assert ns == ns2 and losses == losses2  # deterministic given the seed
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     state["params"], state2["params"]))
    assert set(ns) <= {1, 2, 4} and len(set(ns)) > 1, ns
    ns3, _, _ = _run_steps(spec, config, seed=7, steps=12)
    assert ns3[:6] != ns or len(set(ns3)) > 1


def test_step_config_rejects_bad_depth_settings():
    with pytest.raises(ValueError, match="num_steps_choices"):
        step_lib.StepConfig(num_steps_choices=(0, 2))
    with pytest.raises(ValueError, match="not both"):
        step_lib.StepConfig(num_steps=4, num_steps_choices=(2, 4))
    with pytest.raises(ValueError, match="kinetic_energy_weight"):
        step_lib.StepConfig(kinetic_energy_weight=-1.0)


def test_smoothness_separates_paper_and_smooth_time_features():
    """At init, the paper's sin(1000·t·ω) features move W(t) orders of magnitude faster."""
    from ode_lm.analysis.depth import weight_smoothness

    rates = {}
    for scale, period in ((1000.0, 10000.0), (4.0, 100.0)):
        model = build_model(tiny_config(time_scale=scale, time_max_period=period), nnx.Rngs(0))
        rates[scale] = weight_smoothness(model.weights_at, num_times=33)["max"]
    assert rates[1000.0] > 30 * rates[4.0], rates


