"""tools/gpu_session.sh --dry-run: the prepared accelerator session, end to end on the CPU
with micro sizes, so the script an accelerator host runs cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = ("env", "smoke", "attention", "parity", "determinism", "resume", "bench", "real_run",
         "profile")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_writes_every_step_and_the_summary(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script's own flags
    env["OUT"] = str(out)
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_session.sh"), "--dry-run"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # what comes back: a few plain files, none in folders
    files = sorted(p.name for p in out.iterdir())
    assert {"summary.json", "session.log", "steps.tar.gz"} <= set(files), files
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir()), files
    with tarfile.open(out / "steps.tar.gz") as tar:
        names = set(tar.getnames())
        results = {s: json.load(tar.extractfile(f"steps/{s}.json")) for s in STEPS}
    for s in STEPS:
        assert {f"steps/{s}.status", f"steps/{s}.log"} <= names, s
    assert any(n.startswith("steps/events.out.tfevents.") for n in names)  # TensorBoard
    summary = json.loads((out / "summary.json").read_text())
    failed = {k: v.get("log_tail") for k, v in summary["steps"].items() if not v["ok"]}
    assert summary["all_ok"] and not failed, failed
    assert set(STEPS) <= set(summary["steps"])
    # the checks compared what they say they compared
    assert results["determinism"]["equal"] and results["resume"]["losses_equal"]
    assert results["resume"]["params_equal"] and results["resume"]["saved_at_kill"]
    assert all(c["ok"] for c in results["parity"]["checks"].values())
    assert results["attention"]["checks"]["xla/float32"]["ok"]
    figures = summary["figures"]
    assert figures["ode_tokens_per_s"] > 0 and figures["train_tokens_per_s"] > 0
    assert figures["ode_vanilla_step_ratio"] > 0 and figures["attention_fwd_bwd_ms"]["xla"] > 0
