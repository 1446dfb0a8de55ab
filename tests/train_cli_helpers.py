"""The subprocess harness of the end-to-end train CLI tests (test_train_cli,
test_train_cli_anytime, test_train_cli_mixture) and of every SIGKILL test: the micro run's
gin, starting runs, killing them after a random checkpoint (``sigkill_after_checkpoint``,
``kill_and_resume``), reading back losses, checkpoints and parameters."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
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
TrainConfig.eval_solves = ('steps=4',)
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


def write_gin(workdir: Path, name: str, model_dir: Path, steps: int = 2 * K,
              extra: str = "") -> Path:
    """``<name>.gin``: the micro run, the recipe above, then ``extra`` (later bindings win)."""
    path = workdir / f"{name}.gin"
    path.write_text(micro_cli_gin(workdir / "data", model_dir, train_steps=steps,
                                  ici="(-1, 1, 1)") + RECIPE_GIN + extra)
    return path


def reference_run(workdir: Path, extra: str = "") -> tuple[Path, str]:
    """An uninterrupted 2K-step run (gin ``extra`` added): its model dir and stdout."""
    model_dir = workdir / "reference"
    rc, out, err = run(workdir, write_gin(workdir, "reference", model_dir, extra=extra))
    assert rc == 0, err[-3000:]
    return model_dir, out


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


def sigkill_after_checkpoint(proc: subprocess.Popen, model_dir: Path, last_step: int,
                             jitter: float = 0.1) -> None:
    """SIGKILL ``proc`` (a run writing ``model_dir``) once the checkpoint of a random step in
    ``[1, last_step]`` exists, at a random moment up to ``jitter`` s later (a later save may
    be half written)."""
    rng = random.Random()
    kill_after = rng.randint(1, last_step)
    deadline = time.time() + 600
    while max(checkpoint_steps(model_dir), default=0) < kill_after and proc.poll() is None:
        assert time.time() < deadline, "the run never reached its checkpoints"
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, jitter))
    proc.send_signal(signal.SIGKILL)


def kill_and_resume(workdir: Path, reference: Path, extra: str = "") -> None:
    """The train CLI's SIGKILL test: the run of ``reference_run(workdir, extra)``'s settings
    is killed after a random checkpoint in its first K steps, run again, and must resume and
    end with the losses and parameters of the uninterrupted ``reference``, bit for bit."""
    model_dir = workdir / "killed"
    gin_file = write_gin(workdir, "killed", model_dir, extra=extra)
    proc = start(workdir, gin_file)
    sigkill_after_checkpoint(proc, model_dir, K)
    proc.wait()
    killed_at = checkpoint_steps(model_dir)
    assert killed_at and killed_at[-1] < 2 * K, (killed_at, proc.stderr.read()[-3000:])
    rc, out, err = run(workdir, gin_file)
    assert rc == 0, err[-3000:]
    assert "resumed from step" in out
    assert losses(model_dir) == losses(reference)
    assert_same_params(reference, model_dir)


def assert_same_params(a: Path, b: Path, step: int = 2 * K) -> None:
    """Bitwise-equal parameters at the final ``step`` (restored params-only on one CPU)."""
    from flax import nnx

    from ode_lm.training.checkpoint import tree_equal
    from ode_lm.training.saved_run import load_model

    model_a, run_a = load_model(str(a))
    model_b, run_b = load_model(str(b))
    assert run_a.step == run_b.step == step
    assert tree_equal(nnx.state(model_a, nnx.Param), nnx.state(model_b, nnx.Param))
