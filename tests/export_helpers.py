"""Shared by the export / fine-tuning tests: a tiny saved run directory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_helpers
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from model_helpers import LIVELY

from ode_lm import partitioning
from ode_lm.models import ModelConfig, build_model
from ode_lm.models.solve import Solve
from ode_lm.training.checkpoint import CheckpointConfig, Checkpointer
from ode_lm.training.run_dir import RunDir


def tiny_config(flavour: str, **kw) -> ModelConfig:
    """The LIVELY tiny model of ``flavour`` (model_helpers)."""
    return model_helpers.tiny_config(LIVELY, flavour=flavour, **kw)


def make_run(model_dir: str, config: ModelConfig, step: int = 5, seed: int = 0):
    """Save a run as the trainer does, sharded over an 8-device mesh, with optimizer state."""
    mesh = partitioning.create_mesh((1, 4, 2))
    rules = partitioning.axis_rules()
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        model = build_model(config, nnx.Rngs(seed))
        state = nnx.state(model, nnx.Param)
        shardings = nnx.to_pure_dict(nnx.get_named_sharding(state, mesh))
    params = jax.tree.map(lambda x, s: jax.device_put(x, s),
                          nnx.to_pure_dict(state), shardings)
    opt = {"mu": jax.tree.map(jnp.ones_like, params)}
    ckpt = Checkpointer(model_dir, CheckpointConfig(async_save=False))
    ckpt.save(step, {"step": jnp.int32(step), "params": params, "opt_state": opt}, force=True)
    ckpt.close()
    RunDir(model_dir).write_model_config(config)
    sharded = [x for x in jax.tree.leaves(params)
               if isinstance(x.sharding, NamedSharding) and len(x.sharding.device_set) > 1]
    assert sharded, "the run should be saved from a multi-device mesh"
    return nnx.merge(*nnx.split(build_model(config, nnx.Rngs(seed))))


def logits(model, tokens: np.ndarray, num_steps=None) -> np.ndarray:
    return np.asarray(model(jnp.asarray(tokens, jnp.int32), solve=Solve(None, num_steps)))
