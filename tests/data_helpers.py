"""Shared helpers for the data tests: one prepared built-in corpus per test process."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

from ode_lm.data import DataConfig, ensure_prepared

_CACHE: dict[str, DataConfig] = {}
_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="ode_lm_data_tests_"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def builtin_config(tokenizer: str = "bpe:1024", **overrides) -> DataConfig:
    """The built-in corpus, prepared once per process (holdout 5% so validation is sizeable)."""
    key = tokenizer
    if key not in _CACHE:
        cfg = DataConfig(data_dir=str(_ROOT / tokenizer.replace(":", "-")), tokenizer=tokenizer,
                         holdout_fraction=0.05, seq_len=64, global_batch_size=8, prefetch=0)
        ensure_prepared(cfg)
        _CACHE[key] = cfg
    return dataclasses.replace(_CACHE[key], **overrides)


def write_jsonl(path: pathlib.Path, texts: list[str], field: str = "text") -> pathlib.Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def small_texts(n: int = 60) -> list[str]:
    """Deterministic synthetic documents of varied lengths."""
    words = "ode vector field time embedding solver steps mesh shard token".split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + (i * 13) % 40)) + f" #{i}"
            for i in range(n)]


def cli_env(xla_cache: pathlib.Path) -> dict[str, str]:
    """The environment of a CLI subprocess as a user runs it: CPU, 8 simulated devices, a
    persistent XLA cache at ``xla_cache``, and no ``ODE_LM_DEBUG`` (errors stay one line)."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_COMPILATION_CACHE_DIR=str(xla_cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("ODE_LM_DEBUG", None)
    return env


def tree_hash(root: pathlib.Path) -> dict[str, str]:
    """relative path -> sha256 of every file, and '<dir>' for every directory."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "<dir>" for p in sorted(root.rglob("*"))}


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


_RESUME = textwrap.dedent("""
    import dataclasses, json, sys
    import numpy as np, grain, orbax.checkpoint as ocp
    from ode_lm.data import DataConfig, make_train_iterator
    cfg = DataConfig(**json.loads(sys.argv[1]))
    mode, ckpt, out, k = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    it = make_train_iterator(cfg, process_index=0, process_count=1)
    mngr = ocp.CheckpointManager(ckpt, item_names=("data",))
    if mode == "restore":
        mngr.restore(k, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it)))
    batches = [next(it) for _ in range(k)]
    if mode == "save":
        mngr.save(k, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
    np.savez(out, **{f"{i}_{key}": v for i, b in enumerate(batches) for key, v in b.items()})
""")


def run_resume_script(cfg, mode, ckpt, out, k):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    subprocess.run([sys.executable, "-c", _RESUME, json.dumps(args), mode, str(ckpt), str(out),
                    str(k)], check=True, env=env, timeout=240)
    data = np.load(out)
    return [{key: data[f"{i}_{key}"] for key in ("inputs", "targets", "segment_ids", "positions",
                                                  "loss_mask")} for i in range(k)]


# The micro DiffEqFormer of the CLI tests (seconds to compile on 2 cores): prepend to a run's
# gin text, which adds SEQ_LEN, BATCH_SIZE, VOCAB_SIZE, DATA_DIR, MODEL_DIR and the loop.
MICRO_MODEL_GIN = """include 'models/tiny.gin'
include 'data/builtin.gin'
D_MODEL = 32
NUM_HEADS = 2
ODE_STEPS = 2
TIME_EMBED_DIM = 4
TOKENIZER = 'bytes'
ModelConfig.sinusoidal_dim = 4
"""

# A CLI run of the micro model on the built-in corpus that saves every step.
MICRO_CLI_GIN = MICRO_MODEL_GIN + """SEQ_LEN = 32
BATCH_SIZE = 8
VOCAB_SIZE = 384
DATA_DIR = '{data_dir}'
MODEL_DIR = '{model_dir}'
TRAIN_STEPS = {train_steps}
train.model_dir = %MODEL_DIR
train.num_train_steps = %TRAIN_STEPS
TrainConfig.log_every = 1
CheckpointConfig.save_every = 1
MeshConfig.ici_parallelism = {ici}
DataConfig.eval_max_batches = 1
"""


def micro_cli_gin(data_dir, model_dir, *, train_steps: int, ici: str) -> str:
    """``MICRO_CLI_GIN`` for one run (``ici``: the mesh, e.g. ``'(-1, 1, 1)'``)."""
    return MICRO_CLI_GIN.format(data_dir=data_dir, model_dir=model_dir,
                                train_steps=train_steps, ici=ici)


# The data and optimizer half of the fine-tuning tests' gin (bytes-level, 16 tokens).
FINETUNE_DATA_GIN = """DataConfig.seq_len = 16
DataConfig.global_batch_size = 8
DataConfig.holdout_fraction = 0.2
DataConfig.eval_max_batches = 2
TrainConfig.log_every = 1
OptimizerConfig.learning_rate = 1e-2
OptimizerConfig.warmup_steps = 0
"""
