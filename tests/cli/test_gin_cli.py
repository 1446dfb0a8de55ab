"""The shared gin CLI runner (train, finetune): typos stop before any work, one clean line."""

from __future__ import annotations

import subprocess
import sys

import gin
import pytest

from ode_lm import cli, distributed
from ode_lm.commands import finetune as ft
from ode_lm.commands import train as train_cli


class Joined(RuntimeError):
    """Raised by the stand-in distributed.initialize: 'the run got past the gin checks'."""


@pytest.fixture
def no_join(monkeypatch):
    calls = []

    def initialize(*a, **k):
        calls.append(1)
        raise Joined("joined the job")

    monkeypatch.setattr(distributed, "initialize", initialize)
    yield calls
    gin.clear_config()


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("main", [train_cli.main, ft.main], ids=["train", "finetune"])
@pytest.mark.parametrize("flag, expected", [
    ("--gin.ODE_STEP=8", "--gin.ODE_STEP=8: no loaded config uses the macro ODE_STEP ("),
    ("--gin.NO_SUCH_MACRO_XYZ=3", "the macro NO_SUCH_MACRO_XYZ"),
    ("--gin_bindings=TRAIN_STEP = 5", "macro TRAIN_STEP (did you mean TRAIN_STEPS?)"),
    ("--gin_bindings=Nope.x = 3", "No configurable matching 'Nope'"),
    ("--gin.ModelConfig.d_modle=3", "doesn't have a parameter named 'd_modle'"),
])
def test_gin_typos_stop_before_any_work(main, flag, expected, no_join, capsys):
    gin_file = "runs/demo.gin" if main is train_cli.main else "finetune/demo.gin"
    assert main([f"--gin_file={gin_file}", flag]) == 1
    err = _err(capsys)
    assert expected in err, err
    assert not no_join  # stopped before the multi-host join, let alone a compile


def test_the_closest_macro_is_suggested(no_join, capsys):
    assert train_cli.main(["--gin_file=runs/demo.gin", "--gin.ODE_STEP=8"]) == 1
    assert _err(capsys).endswith("the macro ODE_STEP (did you mean ODE_STEPS?)")


def test_a_used_macro_passes_the_check_and_reaches_the_join(no_join, capsys):
    assert train_cli.main(["--gin_file=runs/demo.gin", "--gin.ODE_STEPS=8"]) == 1
    assert no_join and "joined the job" in _err(capsys)


def test_finetune_joins_the_job_like_train(no_join, capsys):
    assert ft.main(["--gin_file=finetune/demo.gin", "--gin.FINETUNE_STEPS=4"]) == 1
    assert no_join == [1] and "ode-lm-finetune: error: joined the job" in _err(capsys)


EXIT_PROBE = """
import runpy, sys
from ode_lm import distributed
distributed.exit_process = lambda code: print("exit_process", code)
sys.argv = [sys.argv[1], "--help"]
runpy.run_module(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("module", ["ode_lm.commands.train", "ode_lm.commands.finetune"])
def test_cli_modules_leave_through_exit_process(module):
    # a fresh process: the module runs as __main__ once (gin registers its configurables)
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE, module], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout and out.stdout.strip().endswith("exit_process 0")


def test_gin_call_suffix_is_stripped_unless_verbose(monkeypatch, capsys):
    monkeypatch.setattr(distributed, "initialize", lambda *a, **k: None)
    argv = ["--gin_file=runs/demo.gin", "--gin.ODE_STEPS=0"]
    assert train_cli.main(argv) == 2  # a setting ModelConfig refuses: exit 2, no --help
    assert _err(capsys) == "ode-lm-train: error: ModelConfig.num_steps=0: must be >= 1"
    assert train_cli.main([*argv, "--verbose"]) == 2
    err = _err(capsys)
    assert "ModelConfig.num_steps=0: must be >= 1" in err
    assert "In call to configurable 'ModelConfig'" in err
    gin.clear_config()


def test_one_line_strips_nested_suffixes():
    e = ValueError("x=1: bad\n  In call to configurable 'A' (<class 'm.A'>)\n"
                   "  In call to configurable 'train' (<function train at 0x7f00>)")
    assert cli.one_line(e) == "x=1: bad"


@pytest.mark.parametrize("main", [train_cli.main, ft.main], ids=["train", "finetune"])
@pytest.mark.parametrize("knob", ["num_train_steps", "model_dir"])
def test_one_name_per_knob(main, knob, monkeypatch, capsys):
    """train.num_train_steps (TRAIN_STEPS) would silently override TrainConfig.num_train_steps."""
    monkeypatch.setattr(distributed, "initialize", lambda *a, **k: None)
    gin_file = "runs/demo.gin" if main is train_cli.main else "finetune/demo.gin"
    value = "7" if knob == "num_train_steps" else "'/tmp/elsewhere'"
    try:
        assert main([f"--gin_file={gin_file}", f"--gin.TrainConfig.{knob}={value}"]) == 2
    finally:
        gin.clear_config()
    err = _err(capsys)
    entry = "train" if main is train_cli.main else "finetune"
    assert f"TrainConfig.{knob} = " in err and f"bind {entry}.{knob}" in err, err
