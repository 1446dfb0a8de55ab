"""``raw`` format: the model's parameters (hypernetwork included), losslessly.

``model.safetensors`` (sharded with an index above the size threshold) holds every
``nnx.Param`` under its path name (``block/layers/qkv/w0``, ``embeddings/token`` ...);
``config.json`` holds the ``ModelConfig``. ``load_raw`` rebuilds the same model: fp32 raw
exports reproduce the logits bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ode_lm.export import safetensors_io
from ode_lm.models import ModelConfig, build_model

RAW_FORMAT = "ode_lm_raw"


def param_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter as a numpy array keyed by its '/'-joined path."""
    from ode_lm.training.optim import path_name

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {path_name(p): np.asarray(jax.device_get(x)) for p, x in leaves}


def save_raw(model: nnx.Module, config: ModelConfig, out_dir: str, *, dtype: str = "fp32",
             max_shard_bytes: int = safetensors_io.DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    tensors = safetensors_io.cast(param_tensors(model), dtype)
    files = safetensors_io.save_sharded(tensors, out_dir, max_shard_bytes,
                                        metadata={"ode_lm_format": RAW_FORMAT})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"format": RAW_FORMAT, "dtype": dtype,
                   "model_config": dataclasses.asdict(config)}, f, indent=2, sort_keys=True)
    return files


def load_raw(export_dir: str) -> tuple[nnx.Module, ModelConfig]:
    """(model, config) from a ``raw`` export (parameters returned as float32)."""
    path = os.path.join(export_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {export_dir} a raw export?")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != RAW_FORMAT:
        raise ValueError(f"{path}: format={meta.get('format')!r}, expected {RAW_FORMAT!r}")
    config = ModelConfig(**meta["model_config"])
    tensors = safetensors_io.load_sharded(export_dir)
    model = nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0)))
    from ode_lm.training.optim import path_name

    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for p, var in flat.items():
        if not isinstance(var, nnx.Param):
            continue
        name = path_name(p)
        if name not in tensors:
            raise ValueError(f"{export_dir}: parameter {name!r} missing from the raw export")
        value = tensors.pop(name)
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{export_dir}: {name!r} has shape {value.shape}, the model "
                             f"wants {tuple(var.shape)}")
        flat[p] = var.replace(jnp.asarray(value, jnp.float32))
    if tensors:
        raise ValueError(f"{export_dir}: unexpected tensors {sorted(tensors)[:5]}")
    return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items()))), config
