"""Scaling report: final eval loss against training FLOPs, one series per ODE step count.

Reads each run's model config (``RunDir.model_config``, written by the trainer) and its
TensorBoard event files, computes training FLOPs = analytic flops_per_token x tokens seen,
fits a power law L = a * C^b per series (least squares in log-log), and writes ``scaling.png``,
``scaling.csv`` and ``fits.csv``.

    ode-lm scaling-report /tmp/sweep --out /tmp/sweep/report
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import math
import os
from collections.abc import Callable, Sequence

import numpy as np

from ode_lm import cli
from ode_lm.training.metric_names import LOSS, name

LOSS_TAG = name(LOSS)
TOKENS_TAG = "train/tokens_seen"


@dataclasses.dataclass(frozen=True)
class RunPoint:
    name: str
    run_dir: str
    width: int
    num_steps: int
    time_embed_dim: int
    flops_per_token: float
    tokens_seen: float
    train_flops: float
    final_step: int
    final_eval_loss: float


@dataclasses.dataclass(frozen=True)
class PowerLaw:
    """L = a * C^b over one series, with the fit's R^2 in log space."""

    num_steps: int
    a: float
    b: float
    r2: float
    points: int

    def __call__(self, flops: np.ndarray) -> np.ndarray:
        return self.a * np.power(flops, self.b)


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``run_dir`` (all event files, any depth), by tag, sorted by step."""
    from tensorboard.backend.event_processing import event_accumulator

    files = sorted(glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"),
                             recursive=True))
    out: dict[str, dict[int, float]] = {}
    for path in files:
        acc = event_accumulator.EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):  # later files / events win for a repeated step
                out.setdefault(tag, {})[event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in out.items()}


def find_runs(paths: Sequence[str]) -> list[str]:
    """Run dirs (holding a model config) given directly or up to two levels below."""
    from ode_lm.training.run_dir import MODEL_CONFIG

    runs = []
    for p in paths:
        if not os.path.isdir(p):
            raise FileNotFoundError(f"run path {p!r} is not a directory")
        for pattern in ("", "*", os.path.join("*", "*")):
            runs += glob.glob(os.path.join(p, pattern, MODEL_CONFIG))
    return sorted({os.path.dirname(r) for r in runs})


def collect(run_dirs: Sequence[str], loss_tag: str = LOSS_TAG, tokens_tag: str = TOKENS_TAG,
            flops_fn: Callable | None = None) -> list[RunPoint]:
    """One point per run: its last eval loss and its training FLOPs at that step (per token:
    ``flops_fn(config)``, by default ``models.accounting``'s training count at the run's N)."""
    from ode_lm.models.accounting import flops_per_token
    from ode_lm.training.run_dir import RunDir

    flops_fn = flops_fn or (lambda config: float(flops_per_token(config).training))
    points = []
    for run_dir in run_dirs:
        config = RunDir(run_dir).model_config()
        scalars = read_scalars(run_dir)
        for tag in (loss_tag, tokens_tag):
            if tag not in scalars:
                raise ValueError(f"run {run_dir}: no {tag!r} scalars in its TensorBoard logs "
                                 f"(has {sorted(scalars) or 'none'}); is the run finished?")
        step, loss = scalars[loss_tag][-1]
        tokens = _value_at(scalars[tokens_tag], step)
        fpt = flops_fn(config)
        points.append(RunPoint(
            name=os.path.basename(os.path.normpath(run_dir)), run_dir=run_dir,
            width=config.d_model, num_steps=config.num_steps,
            time_embed_dim=config.time_embed_dim, flops_per_token=fpt, tokens_seen=tokens,
            train_flops=fpt * tokens, final_step=int(step), final_eval_loss=float(loss)))
    return points


def _value_at(series: list[tuple[int, float]], step: int) -> float:
    """The last logged value at or before ``step`` (tokens are logged every log_every steps)."""
    before = [v for s, v in series if s <= step]
    return float(before[-1] if before else series[0][1])


def fit_power_law(flops: Sequence[float], loss: Sequence[float], num_steps: int) -> PowerLaw:
    """Least squares on log L = log a + b log C; needs two distinct FLOP values."""
    x, y = np.log(np.asarray(flops, float)), np.log(np.asarray(loss, float))
    if len(set(np.round(x, 12))) < 2:
        raise ValueError(f"series N={num_steps}: a power law needs >= 2 distinct FLOP values")
    b, log_a = np.polyfit(x, y, 1)
    pred = log_a + b * x
    ss_res, ss_tot = float(np.sum((y - pred) ** 2)), float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return PowerLaw(num_steps, float(math.exp(log_a)), float(b), r2, len(x))


def fit_series(points: Sequence[RunPoint]) -> list[PowerLaw]:
    fits = []
    for n in sorted({p.num_steps for p in points}):
        series = [p for p in points if p.num_steps == n]
        if len({p.train_flops for p in series}) >= 2:
            fits.append(fit_power_law([p.train_flops for p in series],
                                      [p.final_eval_loss for p in series], n))
    return fits


def write_csv(points: Sequence[RunPoint], fits: Sequence[PowerLaw], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    fields = [f.name for f in dataclasses.fields(RunPoint)]
    with open(os.path.join(out_dir, "scaling.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for p in sorted(points, key=lambda p: (p.num_steps, p.train_flops)):
            w.writerow(dataclasses.asdict(p))
    with open(os.path.join(out_dir, "fits.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[f.name for f in dataclasses.fields(PowerLaw)])
        w.writeheader()
        for fit in fits:
            w.writerow(dataclasses.asdict(fit))


def plot(points: Sequence[RunPoint], fits: Sequence[PowerLaw], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    by_n = {f.num_steps: f for f in fits}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(sorted({p.num_steps for p in points})):
        series = sorted((p for p in points if p.num_steps == n), key=lambda p: p.train_flops)
        c = colors[i % len(colors)]
        xs = np.array([p.train_flops for p in series])
        label = f"N={n} ODE steps"
        if n in by_n:
            fit = by_n[n]
            label += f": L = {fit.a:.3g}·C^{fit.b:.3f}"
            grid = np.geomspace(xs.min(), xs.max(), 50)
            ax.plot(grid, fit(grid), "--", color=c, lw=1)
        ax.plot(xs, [p.final_eval_loss for p in series], "o", color=c, label=label)
        for p in series:
            ax.annotate(f"width {p.width}", (p.train_flops, p.final_eval_loss), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs (analytic flops/token x tokens)")
    ax.set_ylabel("final eval loss")
    ax.set_title("DiffEqFormer scaling: eval loss vs compute")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser(prog: str = "ode-lm scaling-report") -> argparse.ArgumentParser:
    p = cli.doc_parser(prog, __doc__)
    p.add_argument("runs", nargs="+", help="run dirs, or a sweep root holding them")
    p.add_argument("--out", required=True, help="folder for scaling.png/.csv and fits.csv")
    p.add_argument("--loss_tag", default=LOSS_TAG)
    p.add_argument("--tokens_tag", default=TOKENS_TAG)
    return p


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm scaling-report") -> int:
    args = build_parser(prog).parse_args(argv)
    return cli.run_command(prog, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    from ode_lm.training.run_dir import MODEL_CONFIG

    run_dirs = find_runs(args.runs)
    if not run_dirs:
        raise ValueError(f"no run dirs (with {MODEL_CONFIG}) under {args.runs}")
    points = collect(run_dirs, args.loss_tag, args.tokens_tag)
    fits = fit_series(points)
    write_csv(points, fits, args.out)
    plot(points, fits, os.path.join(args.out, "scaling.png"))
    print(f"{'run':<28} {'N':>3} {'width':>5} {'train FLOPs':>12} {'eval loss':>9}")
    for pt in sorted(points, key=lambda q: (q.num_steps, q.train_flops)):
        print(f"{pt.name:<28} {pt.num_steps:>3} {pt.width:>5} {pt.train_flops:>12.3e} "
              f"{pt.final_eval_loss:>9.4f}")
    for fit in fits:
        print(f"N={fit.num_steps}: L = {fit.a:.4g} * C^{fit.b:.4f}  (R^2 {fit.r2:.3f}, "
              f"{fit.points} runs)")
    print(f"wrote {args.out}/scaling.png, scaling.csv, fits.csv")
    return 0
