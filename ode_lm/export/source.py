"""What an export starts from: a run directory's model (LoRA merged), config and data dir.

Pretraining runs are rebuilt with ``training.trainer.restore_model``. Fine-tuning runs
(``ode_lm.finetune``) leave ``finetune.json`` next to ``model_config.json``; a LoRA run's
checkpoints hold the wrapped model, so it is rebuilt wrapped and its updates merged.
Parameters only are read (never the optimizer state), onto one CPU device, from a
checkpoint saved on any mesh.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
from flax import nnx

FINETUNE_FILE = "finetune.json"


def read_finetune_info(model_dir: str) -> dict[str, Any] | None:
    path = os.path.join(model_dir, FINETUNE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_run_model(model_dir: str, step: int | None = None):
    """(model, ModelConfig, step) with any LoRA update merged into the weights."""
    from ode_lm import partitioning
    from ode_lm.training import checkpoint as ckpt_lib
    from ode_lm.training.trainer import restore_model

    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"--model_dir={model_dir}: no such directory")
    info = read_finetune_info(model_dir)
    if info is None or info.get("method") != "lora":
        return restore_model(model_dir, step)
    import optax

    from ode_lm.lora import lora_model_fn, lora_spec_from_dict, merge_lora
    from ode_lm.training import state as state_lib

    config = ckpt_lib.load_model_config(model_dir)
    mesh = partitioning.create_mesh((1, 1, 1), devices=[jax.devices("cpu")[0]])
    spec = state_lib.build_state_spec(
        lora_model_fn(config, lora_spec_from_dict(info["lora"])), optax.identity(), mesh,
        partitioning.axis_rules())
    params, step = ckpt_lib.restore_params(model_dir, spec.abstract_params, step)
    model = nnx.merge(spec.graphdef, nnx.State(params), spec.rest)
    return merge_lora(model), config, step


_ASSIGN = re.compile(r"^\s*([\w.]+)\s*=\s*(.+?)\s*$")


def _gin_values(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _resolve(values: dict[str, str], key: str) -> str | None:
    v = values.get(key)
    for _ in range(8):  # follow %MACRO references
        if v is None or not v.startswith("%"):
            break
        v = values.get(v[1:])
    if v is None:
        return None
    return v.strip("'\"")


def run_data_dir(model_dir: str) -> str | None:
    """The prepared-data dir of a run (from its ``config.gin``; fine-tunes: their own)."""
    path = os.path.join(model_dir, "config.gin")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return _resolve(_gin_values(f.read()), "DataConfig.data_dir")
