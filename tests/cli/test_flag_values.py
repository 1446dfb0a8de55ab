"""The flag checks and small texts of the commands, without a run: a bad flag value is a
usage error naming the flag typed, ``eval --solves`` parses as documented, ``sample`` says
the solve and the true token count, the depth report's adaptive rows fill their table, help
text has no reST markup, an export swaps in only when complete, and ``aot`` quiets libtpu
before it loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ode_lm import cli
from ode_lm.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


def test_a_bad_solver_names_the_flag_typed():
    with pytest.raises(UsageError, match=r"^--solvers='rk5': expected one of"):
        cli.check_solver_flags("rk5", None, None, flag="--solvers")
    with pytest.raises(UsageError, match=r"^--solver='rk5'"):
        cli.check_solver_flags("rk5", None, None)
    with pytest.raises(UsageError, match=r"^--atol=-1: must be >= 0"):
        cli.check_solver_flags(None, None, -1)


def test_an_out_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match=f"^--data_dir={tmp_path}/f: is a file"):
        cli.check_out_dir(str(tmp_path / "f"), "--data_dir")
    cli.check_out_dir(str(tmp_path))  # a directory, or nothing there: fine
    cli.check_out_dir(str(tmp_path / "new"))


def test_help_text_is_plain():
    assert cli.plain_text("reads ``metrics.jsonl`` and ``model_config.json``") == \
        "reads metrics.jsonl and model_config.json"


def test_solves_parse_in_order():
    from ode_lm.commands.eval import parse_solves
    from ode_lm.models.solve import Solve

    assert parse_solves("euler:4,6 rk4:8 adaptive:1e-3 12") == [
        Solve("euler", 4), Solve("euler", 6), Solve("rk4", 8), Solve("adaptive", rtol=1e-3),
        Solve(None, 12)]


@pytest.mark.parametrize("text, message", [
    ("rk5:4", "'rk5:4': solver 'rk5' is not one of"),
    ("euler:4,x", "'x' is not a whole number of steps"),
    ("adaptive:tight", "'tight' is not a tolerance"),
    ("euler:0", "steps must be > 0"),
    ("", "expected e.g."),
])
def test_bad_solves_are_usage_errors(text, message):
    from ode_lm.commands.eval import parse_solves

    with pytest.raises(UsageError, match="^--solves=") as e:
        parse_solves(text)
    assert message in str(e.value)


def test_eval_prints_each_gap():
    from ode_lm.commands.eval import gap_lines

    lines = gap_lines({"step": 2.0, "eval/perplexity": 100.0, "eval/perplexity@steps=4": 101.0,
                       "eval/depth_gap/steps=4": 0.01}).splitlines()
    assert lines == ["own solver and N: perplexity 100.00",
                     "steps=4: perplexity 101.00, gap +1.00%"]


def test_sample_says_the_solver_and_the_true_count():
    from ode_lm.commands.sample import count_text, solve_text
    from ode_lm.models.config import ModelConfig

    config = ModelConfig(num_steps=8)
    args = argparse.Namespace(solver=None, num_steps=None, rtol=None)
    assert solve_text(args, config) == f"{config.solver} M=8"
    args = argparse.Namespace(solver="adaptive", num_steps=None, rtol=1e-2)
    assert solve_text(args, config) == "adaptive rtol=0.01"
    assert count_text([64], 64) == "1 prompt x 64 tokens"
    assert count_text([20, 64], 64) == \
        "2 prompts: 20, 64 of 64 tokens (stopped at end-of-text)"


def test_depth_report_adaptive_rows_fill_the_table():
    from ode_lm.commands.depth_report import _table

    rep = {"trained_num_steps": 2, "smoothness": 0.1,
           "ppl": {"euler": {"2": 10.0, "4": 9.0}, "rk4": {"2": 9.5, "4": 9.1}},
           "adaptive": [{"rtol": 1e-3, "ppl": 9.2, "nfe": 30.0}]}
    rows = [line for line in _table({"run": rep}).splitlines() if line.startswith("|")]
    cells = {line.count("|") for line in rows}
    assert cells == {4}, rows  # solver + 2 N columns, every row
    assert "adaptive rtol=0.001: ppl 9.2, NFE 30.0" in rows[-1]


def test_staged_export_dir_swaps_in_whole_or_not_at_all(tmp_path):
    from ode_lm.export.convert import staged_dir

    out = tmp_path / "export"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_dir(str(out)) as staging:
        Path(staging, "new.txt").write_text("half")
        raise RuntimeError("the export failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    with staged_dir(str(out)) as staging:
        Path(staging, "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert [p.name for p in out.iterdir()] == ["new.txt"]


def test_aot_quiets_libtpu_before_it_loads():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env["PYTHONPATH"] = str(REPO)
    code = ("import os, sys; import ode_lm.commands.aot; "
            "print(os.environ['TPU_STDERR_LOG_LEVEL'], os.environ['TPU_MIN_LOG_LEVEL'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    assert out == ["3", "3"]
    env["TPU_STDERR_LOG_LEVEL"] = "0"  # asked for: kept
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    assert out == ["0", "3"]


def test_a_failed_prepare_leaves_no_progress_bar_line(tmp_path, monkeypatch, capsys):
    """On a terminal the bar is drawn; when a chunk fails it is erased, not left as a line
    above the error (off a terminal ``ode-lm prepare`` draws none)."""
    import importlib
    import json

    from ode_lm.data import DataConfig

    prep = importlib.import_module("ode_lm.data.prepare")
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n"
                              for i in range(300)))
    real = prep._process_chunk

    def fail_third(root, chunk, *args):
        if chunk == 2:
            raise OSError("No space left on device")
        return real(root, chunk, *args)

    monkeypatch.setattr(prep, "_process_chunk", fail_third)
    cfg = DataConfig(source=str(source), data_dir=str(tmp_path / "data"), tokenizer="bytes",
                     docs_per_shard=50)
    with pytest.raises(OSError, match="No space left"):
        prep.prepare(cfg, num_proc=1, progress=True, log=lambda *_: None)
    err = capsys.readouterr().err
    assert "prepare:" in err and "\n" not in err  # drawn, then erased: no line left
    assert err.split("\r")[-1].strip() == ""


def test_prepare_warnings_wait_for_the_outcome(tmp_path):
    """A skipped file's warning is printed after a run that succeeds, and not before the one
    error line of a run that fails (the error says what was skipped)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("ODE_LM_DEBUG", None)

    def prepare(source: Path, data: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ode_lm", "prepare", f"--source={source}",
                               f"--data_dir={tmp_path / data}", "--tokenizer=bytes",
                               "--no_progress", "--num_proc=1"], env=env, capture_output=True,
                              text=True, timeout=300)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    r = prepare(empty, "d1")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("ode-lm prepare: error: ") and "1 empty" in r.stderr
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("")
    (mixed / "b.txt").write_text("a document")
    r = prepare(mixed, "d2")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()  # then those on splits too small for the demo
    assert lines[0] == (
        f"ode-lm prepare: warning: source file skipped (empty): {mixed / 'a.txt'}: empty file")
    assert all(line.startswith("ode-lm prepare: warning: split ") for line in lines[1:]), lines
