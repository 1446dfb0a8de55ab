"""``TrainConfig.compilation_cache_dir``: the run's programs go to jax's persistent cache,
so a resume in the same directory compiles nothing new."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import train_cli_helpers as cli

from ode_lm.training.trainer import use_compilation_cache

pytestmark = pytest.mark.slow


def _train(workdir: Path, gin: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program, however quick
    return subprocess.run([sys.executable, "-m", "ode_lm.commands.train", f"--gin_file={gin}",
                           f"--gin.TrainConfig.compilation_cache_dir='{cache}'", *extra],
                          env=env, capture_output=True, text=True, timeout=600)


def _rewind(model_dir: Path, to: int) -> None:
    """The run as a preemption after step ``to`` leaves it: later checkpoints gone."""
    import shutil

    for ckpt in (model_dir / "checkpoints").iterdir():
        if ckpt.name.isdigit() and int(ckpt.name) > to:
            shutil.rmtree(ckpt)


def test_a_resume_with_a_warm_cache_compiles_nothing_new(tmp_path):
    """A resume compiles what a restore adds once (its checks); the next resume of the same
    settings reads every program back. (A rerun with another TRAIN_STEPS compiles its step
    anew: the learning-rate schedule is part of the program.)"""
    cache = tmp_path / "cache"
    model_dir = tmp_path / "run"
    gin = cli.write_gin(tmp_path, "run", model_dir, steps=4,
                        extra="CheckpointConfig.save_every = 1\n")
    first = _train(tmp_path, gin, cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert any(cache.iterdir())  # the run's programs were written
    _rewind(model_dir, 2)
    second = _train(tmp_path, gin, cache)
    assert second.returncode == 0 and "resumed from step 2" in second.stdout, second.stderr
    entries = {p.name for p in cache.iterdir()}
    _rewind(model_dir, 2)
    third = _train(tmp_path, gin, cache)
    assert third.returncode == 0 and "resumed from step 2" in third.stdout, third.stderr
    assert {p.name for p in cache.iterdir()} == entries  # nothing compiled anew


def test_auto_is_the_environments_else_the_buckets_else_the_users(monkeypatch, tmp_path):
    import jax

    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
        assert use_compilation_cache("auto", "gs://b/runs/x") == str(tmp_path / "env")
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        assert use_compilation_cache("auto", "gs://b/runs/x") == "gs://b/ode_lm/xla_cache"
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
        assert use_compilation_cache("auto", "/tmp/run") == str(tmp_path / "home/ode_lm/xla")
        assert use_compilation_cache("", "/tmp/run") is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
