"""Gathers tools/gpu_session.sh's step results into one ``summary.json`` and a short table.

    python tools/gpu_summary.py run-figures --model_dir D --out run.json
    python tools/gpu_summary.py summary --steps_dir S --out summary.json

Each step of the session leaves ``<name>.status`` (rc, seconds, budget) from the shell and,
when it got that far, ``<name>.json`` from its check; a step without its JSON is reported
as failed with the tail of its log, so a timed-out step still shows in the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run_figures(model_dir: Path) -> dict:
    """The trainer's own throughput: last logged tokens/s, MFU and loss of its metrics."""
    from ode_lm.training.run_dir import RunDir

    run = RunDir(str(model_dir))
    rows = [json.loads(x) for x in Path(run.metrics).read_text().splitlines()]
    timed = [r for r in rows if "train/tokens_per_second" in r]
    last = timed[-1] if timed else {}
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    return {
        "steps_logged": len(rows), "last_step": rows[-1]["step"] if rows else None,
        "tokens_per_second": last.get("train/tokens_per_second"),
        "mfu": last.get("train/mfu"),
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "tensorboard_files": [Path(p).name for p in run.event_files()],
        "ok": bool(timed) and bool(list(model_dir.glob("events.out.tfevents.*"))),
    }


def figures(steps: dict) -> dict:
    """The headline numbers, each None where its step did not produce it."""
    def get(step, *keys):
        x = steps.get(step, {}).get("result") or {}
        for k in keys:
            x = x.get(k) if isinstance(x, dict) else None
        return x

    bench = get("bench", "summary") or {}
    compare = get("bench", "groups", "compare") or [None, None]
    ode = compare[1] if len(compare) > 1 else None
    return {
        "ode_mfu_vs_accelerator_peak": ode and ode.get("mfu_vs_accelerator_peak"),
        "ode_vanilla_step_ratio": (bench.get("ode_vanilla_step_ratio") or {}).get("value"),
        "ode_tokens_per_s": ode and ode.get("tokens_per_s"),
        "ode_compiled_peak_bytes": ode and ode.get("compiled_peak_bytes"),
        "attention_fwd_bwd_ms": {k: v.get("fwd_bwd_ms_median") for k, v in
                                 (get("attention", "timing") or {}).items()
                                 if isinstance(v, dict) and "fwd_bwd_ms_median" in v},
        "train_tokens_per_s": get("real_run", "tokens_per_second"),
        "train_mfu": get("real_run", "mfu"),
    }


def summary(steps_dir: Path) -> dict:
    steps = {}
    for status in sorted(steps_dir.glob("*.status"), key=lambda p: p.stat().st_mtime):
        name = status.stem
        entry = json.loads(status.read_text())
        result_file = steps_dir / f"{name}.json"
        try:
            entry["result"] = json.loads(result_file.read_text())
        except (OSError, json.JSONDecodeError):
            entry["result"] = None
        log = steps_dir / f"{name}.log"
        if entry["rc"] != 0 and log.exists():
            entry["log_tail"] = log.read_text(errors="replace")[-1500:]
        ok = (entry["result"] or {}).get("ok")
        entry["ok"] = entry["rc"] == 0 and entry["result"] is not None and ok is not False
        steps[name] = entry
    return {"steps": steps, "figures": figures(steps),
            "all_ok": bool(steps) and all(s["ok"] for s in steps.values())}


def table(result: dict) -> str:
    lines = [f"{'step':<14} {'rc':>4} {'s':>7} {'budget':>7}  ok"]
    for name, s in result["steps"].items():
        lines.append(f"{name:<14} {s['rc']:>4} {s['seconds']:>7.1f} {s['budget']:>7}  "
                     f"{'yes' if s['ok'] else 'NO'}")
    lines.append("figures: " + json.dumps(result["figures"], default=str))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("run-figures", "summary"))
    p.add_argument("--out", required=True)
    p.add_argument("--model_dir", default=None)
    p.add_argument("--steps_dir", default=None)
    args = p.parse_args(argv)
    if args.command == "run-figures":
        result = run_figures(Path(args.model_dir))
    else:
        result = summary(Path(args.steps_dir))
        print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0 if result.get("ok", result.get("all_ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
