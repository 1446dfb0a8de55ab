"""The subprocess harness of the end-to-end train CLI tests (test_train_cli and
test_train_cli_anytime): the micro run's gin, starting/killing runs, reading back losses,
checkpoints and parameters."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from data_helpers import micro_cli_gin

from ode_lm.training.run_dir import RunDir

K = 4  # the killed run is stopped somewhere in the first K steps of 2K
# micro_cli_gin plus what these runs add (later gin bindings win):
RECIPE_GIN = """
# the depth-robust recipe, so exact resume covers random step counts, grid offsets and the
# kinetic-energy regulariser (the model's own N=2 is what eval/loss uses)
ModelConfig.time_scale = 4.0
ModelConfig.random_grid_offset = True
RandomSteps.choices = (1, 2, 3)
KineticEnergy.weight = 0.5
StepConfig.terms = [@RandomSteps(), @KineticEnergy()]
TrainConfig.eval_every = 0
TrainConfig.eval_num_steps = (4,)
OptimizerConfig.learning_rate = 3e-3
OptimizerConfig.warmup_steps = 2
CheckpointConfig.max_to_keep = 3
DataConfig.eval_max_batches = 2
"""


def _env(cache_dir: Path) -> dict:
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def write_gin(workdir: Path, name: str, model_dir: Path, steps: int = 2 * K) -> Path:
    path = workdir / f"{name}.gin"
    path.write_text(micro_cli_gin(workdir / "data", model_dir, train_steps=steps,
                                  ici="(-1, 1, 1)") + RECIPE_GIN)
    return path


def start(workdir: Path, gin_file: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ode_lm.commands.train", f"--gin_file={gin_file}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(workdir / "xla_cache"))


def run(workdir: Path, gin_file: Path, *extra: str, timeout: int = 600):
    proc = start(workdir, gin_file, *extra)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def losses(model_dir: Path) -> dict[int, float]:
    """Per-step train loss; a re-run step (after a kill) overwrites the earlier line."""
    text = Path(RunDir(str(model_dir)).metrics).read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def checkpoint_steps(model_dir: Path) -> list[int]:
    d = Path(RunDir(str(model_dir)).checkpoints)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def snapshot(model_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(model_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.rglob("*")) if p.is_file()
    }


def assert_same_params(a: Path, b: Path) -> None:
    """Bitwise-equal parameters at the final step (restored params-only on one CPU)."""
    from flax import nnx

    from ode_lm.training.checkpoint import tree_equal
    from ode_lm.training.saved_run import load_model

    model_a, run_a = load_model(str(a))
    model_b, run_b = load_model(str(b))
    assert run_a.step == run_b.step == 2 * K
    assert tree_equal(nnx.state(model_a, nnx.Param), nnx.state(model_b, nnx.Param))
