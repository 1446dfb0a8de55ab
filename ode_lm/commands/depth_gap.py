"""Depth gap of trained runs over training, read from their metrics files (no re-evaluation).

  ode-lm depth-gap table NAME=DIR[@STEP] ...
  ode-lm depth-gap plot --out=FILE.png NAME=DIR ...

Every in-loop eval of a run (``TrainConfig.eval_num_steps`` / ``eval_solves``) logs a
perplexity at some N or solver; the gap of a setting is its perplexity relative to the run's
own solver and N (``eval/perplexity``), as ``eval/depth_gap/<setting>`` in TensorBoard.
``table`` prints one markdown row per run (the run's own solver at N = 1..24, its own N in
bold, RK4 N=8, adaptive rtol 1e-3, tokens/s; its last eval, or the one at STEP); ``plot``
draws the gap against the training step. Each run's own solver and N are its
``model_config.json``'s, and every figure is looked up by its name
(``training.metric_names``). The tables of docs/depth.md are printed with it.
``ode-lm depth-report`` re-evaluates one checkpoint at every N and solver instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from ode_lm import cli
from ode_lm.training import metric_names as names
from ode_lm.training.run_dir import RunDir

NS = (1, 2, 3, 4, 6, 8, 12, 24)  # the run's own solver at each N
SOLVES = ("rk4:steps=8", "adaptive:rtol=0.001")
SPEED = "train/tokens_per_second"


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's eval rows (by step) and its own solver and N (what a plain name means)."""

    rows: list[dict]
    solver: str
    num_steps: int

    def ppl(self, row: dict, setting: str) -> float | None:
        """Perplexity at ``setting``: an N of the run's own solver as a string ('6'), or a
        solve spec ('rk4:steps=8')."""
        return row.get(self.name(names.PERPLEXITY, setting))

    def name(self, metric: str, setting: str) -> str:
        solve = (names.Solve(self.solver, int(setting)) if setting.isdigit()
                 else names.parse_solve(setting, "setting"))
        return names.name(metric, names.metric_suffix(
            solve.num_steps, self.num_steps, solve.solver, solve.rtol, model_solver=self.solver))


def solver_label(solver: str) -> str:
    """'euler' -> 'Euler', 'rk4' -> 'RK4', 'midpoint' -> 'Midpoint' (as the tables write)."""
    return solver.upper() if solver[-1].isdigit() else solver.capitalize()


def eval_rows(run_dir: str) -> list[dict]:
    """The eval rows of a run's metrics file, by step: the rows of one step merged, a later
    figure winning (a re-run step's, or one ``ode-lm eval --log`` appended)."""
    path = Path(RunDir(run_dir).metrics)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (not a run directory?)")
    own = names.name(names.PERPLEXITY)
    rows: dict[int, dict] = {}
    train: list[dict] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if own in row:
            rows.setdefault(row["step"], {}).update(row)
        if SPEED in row:
            train.append(row)
    for step, row in rows.items():
        speeds = [r[SPEED] for r in train if r["step"] <= step]
        row["tokens_per_second"] = statistics.median(speeds) if speeds else float("nan")
    return [rows[s] for s in sorted(rows)]


def read_run(run_dir: str) -> Run:
    """The run's eval rows, and its own solver and N from its ``model_config.json``."""
    rows = eval_rows(run_dir)
    config = RunDir(run_dir).model_config()
    return Run(rows, config.solver, config.num_steps)


def _cell(value: float | None, own: float, mark_own: bool = False) -> str:
    if value is None:
        return "–"
    text = f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"
    if mark_own:
        return f"**{text}**"
    return text if value >= 1000 else f"{text} ({100 * (value / own - 1):+.1f} %)"


def table(runs: list[tuple[str, str, int | None]]) -> str:
    """Markdown: one row per run (its last eval, or the named step). The N columns are each
    run's own solver, named in the header when the runs share it, else after each name."""
    read = [(name, read_run(run_dir), run_dir, step) for name, run_dir, step in runs]
    solvers = {run.solver for _, run, _, _ in read}
    own = f"{solver_label(solvers.pop())} " if len(solvers) == 1 else ""
    head = ("| recipe | step | " + " | ".join(f"{own}N={n}" for n in NS)
            + " | RK4 N=8 | adaptive 1e-3 (NFE) | tok/s |")
    lines = [head, "|---|---:|" + "---:|" * (len(NS) + 3)]
    for name, run, run_dir, step in read:
        rows = run.rows
        row = rows[-1] if step is None else next((r for r in rows if r["step"] == step), None)
        if row is None:
            raise ValueError(f"{run_dir}: no eval at step {step}")
        ppl = row[names.name(names.PERPLEXITY)]
        cells = [_cell(run.ppl(row, str(n)), ppl, n == run.num_steps) for n in NS]
        rk4 = _cell(run.ppl(row, SOLVES[0]), ppl)
        nfe = row.get(run.name(names.NFE, SOLVES[1]))
        ada = _cell(run.ppl(row, SOLVES[1]), ppl)
        ada = ada if nfe is None else f"{ada[:-1]}, {nfe:.0f})" if ada.endswith(")") else ada
        label = name if own else f"{name} ({solver_label(run.solver)})"
        lines.append(f"| {label} | {row['step']} | " + " | ".join(cells)
                     + f" | {rk4} | {ada} | {row['tokens_per_second'] / 1e3:.2f}k |")
    return "\n".join(lines)


def plot(runs: list[tuple[str, str, int | None]], out: str) -> None:
    """Gap (%) against the run's own N versus training step: RK4 N=8, adaptive, the run's
    own solver at N=4 and N=24 (left), and at N=3 (right, its own scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax3) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"rk4:steps=8": "-", "adaptive:rtol=0.001": "--", "4": ":", "24": "-."}
    for i, (name, run_dir, _) in enumerate(runs):
        run = read_run(run_dir)
        steps = [r["step"] for r in run.rows]
        color, own = f"C{i}", solver_label(run.solver)
        for setting, style in styles.items():
            gaps = [_gap(run, r, setting) for r in run.rows]
            label = f"{name}: " + (f"{own} N={setting}" if setting.isdigit() else setting)
            ax.plot(steps, gaps, style, color=color, marker="o", ms=3, label=label)
        ax3.plot(steps, [_gap(run, r, "3") for r in run.rows], "-", color=color, marker="o",
                 label=f"{name}: {own} N=3")
    for a, title in ((ax, "gap to the trained N (%)"), (ax3, "gap at N=3 (%)")):
        a.axhline(0, color="0.6", lw=0.8)
        a.set_xlabel("training step")
        a.set_ylabel(title)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _gap(run: Run, row: dict, setting: str) -> float:
    value = run.ppl(row, setting)
    return float("nan") if value is None else 100 * (
        value / row[names.name(names.PERPLEXITY)] - 1)


def _parse_run(text: str) -> tuple[str, str, int | None]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR or NAME=DIR@STEP")
    run_dir, at, step = rest.partition("@")
    if at and not step.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: the step after @ must be an integer")
    return name, run_dir, int(step) if at else None


def build_parser(prog: str = "ode-lm depth-gap") -> argparse.ArgumentParser:
    p = cli.doc_parser(prog, __doc__)
    p.add_argument("what", choices=("table", "plot"))
    p.add_argument("runs", nargs="+", type=_parse_run, help="NAME=DIR[@STEP]")
    p.add_argument("--out", help="plot: the PNG to write")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm depth-gap") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.what == "plot" and not args.out:
        parser.error("plot needs --out")
    return cli.run_command(prog, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    if args.what == "table":
        print(table(args.runs))
    else:
        plot(args.runs, args.out)
        print(f"wrote {args.out}")
    return 0
