"""``ode-lm finetune-table`` keys its runs by their settings: the same settings reuse the
finished runs, changed step counts run anew in a directory of their own (never a stale table)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import cli_env

from ode_lm.commands import finetune_table as tool

REPO = Path(__file__).resolve().parents[2]


def _table(work: Path, *flags: str) -> subprocess.CompletedProcess:
    env = cli_env(work / "xla_cache")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-m", "ode_lm", "finetune-table", "--depths=2", "--methods=full",
            f"--work_dir={work / 'ft'}", *flags]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file()}


def test_settings_name_the_directories():
    """The steps are readable in the names; other steps or depths' gin text, another dir."""
    pre, ft = tool.work_dirs("/w", 60, 15)
    assert pre.startswith("/w/pretrain60-") and ft.startswith(pre + "/finetune15-")
    assert tool.work_dirs("/w", 60, 15) == (pre, ft)
    other_pre, other_ft = tool.work_dirs("/w", 60, 16)
    assert other_pre == pre and other_ft != ft
    assert tool.work_dirs("/w", 61, 15)[0] != pre
    assert "D_MODEL = 256" in tool.gin_text(tool.PRETRAIN_GIN)  # its includes are hashed too


@pytest.mark.slow
def test_same_settings_reuse_and_changed_settings_rerun(tmp_path):
    first = _table(tmp_path, "--pretrain_steps=1", "--finetune_steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    pre, ft = (Path(p) for p in tool.work_dirs(str(tmp_path / "ft"), 1, 1))
    assert (ft / "full2" / "finetune_result.json").is_file()
    table = first.stdout.splitlines()[-1]
    assert table.startswith("| 2 | full | 100.0 |")
    before = _mtimes(pre / "run") | _mtimes(ft)

    again = _table(tmp_path, "--pretrain_steps=1", "--finetune_steps=1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reused: same settings" in again.stdout and again.stdout.splitlines()[-1] == table
    assert (_mtimes(pre / "run") | _mtimes(ft)) == before  # nothing trained again

    changed = _table(tmp_path, "--pretrain_steps=1", "--finetune_steps=2")
    assert changed.returncode == 0, changed.stderr[-3000:]
    _, ft2 = (Path(p) for p in tool.work_dirs(str(tmp_path / "ft"), 1, 2))
    assert ft2 != ft and (ft2 / "full2" / "finetune_result.json").is_file()
    assert "pretrained run:" in changed.stdout  # the pretraining is the same: reused
    assert "full at M=2" not in changed.stdout  # the fine-tune is not: trained anew
    assert _mtimes(pre / "run") | _mtimes(ft) == before  # the first runs are left as they were
