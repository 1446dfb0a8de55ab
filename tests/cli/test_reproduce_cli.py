"""``ode-lm reproduce`` end to end on a few steps: a slice of claims trains its runs, prints a
verdict per claim and writes claims.json; the same command again trains nothing and gives the
same verdicts; bad flags are refused in one line before any run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import cli_env

from ode_lm.claims.verdict import VERDICTS

REPO = Path(__file__).resolve().parents[2]
MICRO = REPO / "tests" / "testdata" / "claims" / "micro.gin"
SLICE = "finetune-own-n-no-worse-lora,default-depth-n6-price"


def _reproduce(work: Path, *flags: str) -> subprocess.CompletedProcess:
    env = cli_env(work / "xla_cache")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-m", "ode_lm", "reproduce", f"--work_dir={work / 'claims'}",
            *flags]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file()}


@pytest.mark.slow
def test_a_slice_runs_end_to_end_and_a_rerun_reuses_it(tmp_path):
    flags = [f"--scale={MICRO}", "--seeds=0", f"--claims={SLICE}",
             f"--gin.DATA_DIR='{tmp_path / 'data'}'", f"--json={tmp_path / 'out.json'}"]
    first = _reproduce(tmp_path, *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    data = json.loads((tmp_path / "out.json").read_text())
    assert [c["id"] for c in data["claims"]] == SLICE.split(",")
    for c in data["claims"]:
        assert c["verdict"] in VERDICTS and len(c["values"]) == 1 and c["seeds"] == [0]
        assert c["evidence"][0]["seed"] == 0
    ft = data["claims"][0]["evidence"][0]
    assert ft["finetune_steps"] == 2 and ft["pretrain_steps"] == 4  # micro.gin's budgets
    lines = [ln for ln in first.stdout.splitlines() if "default-depth-n6-price:" in ln]
    assert len(lines) == 1 and "runs trained" in first.stdout.splitlines()[-1]
    assert data["runs_trained"] == 4  # paper ODE + its fine-tune, default + depth-robust
    runs = tmp_path / "claims" / "runs"
    before = _mtimes(runs)

    again = _reproduce(tmp_path, *flags)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "training " not in again.stdout and _mtimes(runs) == before  # nothing trained
    redo = json.loads((tmp_path / "claims" / "claims.json").read_text())
    assert [c["values"] for c in redo["claims"]] == [c["values"] for c in data["claims"]]
    assert redo["runs_trained"] == 0


@pytest.mark.parametrize("flag, message", [
    ("--claims=nope", "--claims=nope: no such claim"),
    ("--seeds=1,1", "--seeds=1,1: distinct seeds"),
    ("--scale=missing.gin", "--scale=missing.gin: no such gin file"),
    ("--corpus=missing.gin", "--corpus=missing.gin: no such gin file"),
    ("--gin.=3", "--gin.=3: expected --gin.NAME=VALUE"),
])
def test_bad_flags_are_one_line_before_any_run(tmp_path, flag, message):
    done = _reproduce(tmp_path, flag)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"ode-lm reproduce: error: {message}"] or (
        len(done.stderr.strip().splitlines()) == 1 and message in done.stderr)
    assert not (tmp_path / "claims").exists()
