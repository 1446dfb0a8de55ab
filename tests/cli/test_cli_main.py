"""The ``ode-lm`` command: its help, dispatch, exit statuses and every subcommand's help."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import terminal

from ode_lm import __version__, main
from ode_lm.commands import COMMANDS

REPO = pathlib.Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_help_lists_every_command_with_its_summary(capsys):
    assert main.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name} " in out and command.summary in out
        assert "\n" not in command.summary and len(command.summary) < 80


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert main.main([]) == 2
    assert "commands:" in capsys.readouterr().err


def test_unknown_command_and_option_are_one_line_usage_errors(capsys):
    assert main.main(["trian"]) == 2
    assert capsys.readouterr().err == "ode-lm: error: unknown command 'trian' (see ode-lm --help)\n"
    assert main.main(["--verbose"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_version(capsys):
    assert main.main(["--version"]) == 0
    assert capsys.readouterr().out == f"ode-lm {__version__}\n"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_argparse_help(name, capsys):
    try:
        code = main.main([name, "--help"])
    except SystemExit as e:  # argparse's own --help
        code = e.code
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ode-lm {name} ") and "options:" in out and "-h, --help" in out


def test_gin_help_names_the_flags_and_lists_the_macros_of_the_files(capsys):
    assert main.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--gin_file", "--gin.NAME=VALUE", "--gin_bindings", "--gin_search_paths",
                 "--verbose", "examples:"):
        assert flag in out
    assert "macros of" not in out
    # demo.gin includes models/tiny.gin (D_MODEL, ODE_STEPS, ...); the flag's value wins
    assert main.main(["train", "--gin_file=configs/runs/demo.gin", "--gin.TRAIN_STEPS=7",
                      "--help"]) == 0
    macros = capsys.readouterr().out.split("macros of configs/runs/demo.gin")[1]
    lines = dict(line.split(" = ", 1) for line in macros.strip().splitlines()[1:])
    lines = {k.strip(): v for k, v in lines.items()}
    assert lines["TRAIN_STEPS"] == "7" and lines["MODEL_DIR"].startswith("'")
    assert {"D_MODEL", "ODE_STEPS", "BATCH_SIZE"} <= set(lines)


def test_gin_help_with_a_missing_file_is_a_one_line_error(capsys):
    assert main.main(["finetune", "--gin_file=nope.gin", "--help"]) == 1
    assert capsys.readouterr().err == "ode-lm finetune: error: --gin_file=nope.gin: no such file\n"


def test_python_dash_m_ode_lm_dispatches():
    r = subprocess.run([sys.executable, "-m", "ode_lm", "eval", "--num_steps=2,four",
                        "--model_dir=x"], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr == ("ode-lm eval: error: argument --num_steps: invalid int value: 'four' "
                        "(in '2,four') (see --help)\n")


def test_the_console_script():
    script = shutil.which("ode-lm")
    if script is None:
        pytest.skip("the ode-lm console script is not on PATH (pip install -e .)")
    r = subprocess.run([script, "--help"], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and all(f"  {name} " in r.stdout for name in COMMANDS)
    r = subprocess.run([script, "sample", "--model_dir=x", "--prompt=a", "--top=1"], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr == ("ode-lm sample: error: unrecognized arguments: --top=1 (see --help)\n")


_LONG_C_CALL = r"""
import sys
import numpy as np
from ode_lm import cli
cli.answer_ctrl_c_at_once("ode-lm sample")
def body():
    print("ready", flush=True)
    a = np.random.default_rng(0).random((1500, 1500))
    for _ in range(10 ** 6):  # C calls without a bytecode between their halves
        a = a @ a
        a /= a.max()
    return 0
def swallowing():  # a library that catches the interrupt and finishes its work
    try:
        return body()
    except KeyboardInterrupt:
        return 0
code = cli.run_command("ode-lm sample", swallowing if SWALLOW else body)
sys.exit(cli.exit_status(code))
"""


@pytest.mark.parametrize("swallow", [False, True])
def test_ctrl_c_is_answered_inside_a_long_c_call_then_exits_130(swallow):
    """Ctrl-C inside long C calls: one line, exit 130, also when something swallowed the
    KeyboardInterrupt and the work ended by itself (the reply and the status agree)."""
    import signal

    source = _LONG_C_CALL.replace("SWALLOW", str(swallow))
    proc = subprocess.Popen([sys.executable, "-c", source], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True,
                            preexec_fn=terminal.foreground)
    assert proc.stdout.readline().strip() == "ready"
    os.killpg(proc.pid, signal.SIGINT)
    line = proc.stderr.readline().strip()
    out, err = proc.communicate(timeout=120)
    assert line == "ode-lm sample: stopped by Ctrl-C" and err.strip() == "", (line, err)
    assert proc.returncode == 130
