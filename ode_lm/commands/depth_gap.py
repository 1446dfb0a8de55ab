"""Depth gap of trained runs over training, read from their metrics files (no re-evaluation).

  ode-lm depth-gap table NAME=DIR[@STEP] ... [--baseline=GROUP] [--json=FILE]
  ode-lm depth-gap plot --out=FILE.png NAME=DIR ...

Every in-loop eval of a run (``TrainConfig.eval_solves``) logs a
perplexity at some N or solver; the gap of a setting is its perplexity relative to the run's
own solver and N (``eval/perplexity``), as ``eval/depth_gap/<setting>`` in TensorBoard.
``table`` prints one markdown row per run (the run's own solver at N = 1..24, its own N in
bold, RK4 N=8, adaptive rtol 1e-3, tokens/s; its last eval, or the one at STEP); ``plot``
draws the gap against the training step. ``table --json`` also writes the figures with
their provenance: what tools/doc_tables.py regenerates the tables of docs/depth.md from.
``table --baseline=GROUP`` compares recipes seed by seed: runs named ``GROUP, seed S`` form
groups, and after the runs come each group's mean (its own N with the standard error over
its seeds) and each other group's paired difference to GROUP (mean ± standard error over
the seeds both have; ``analysis.seeds``).
Each run's own solver and N are its ``model_config.json``'s, and every figure is looked up
by its name (``training.metric_names``). A run with no
eval yet, or whose evals measured only its own solver and N, is refused in one line (exit 1,
no chart written): it has no gap to show.
``ode-lm depth-report`` re-evaluates one checkpoint at every N and solver instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from ode_lm import cli
from ode_lm.models.solve import Solve
from ode_lm.training import metric_names as names
from ode_lm.training.run_dir import SUMMARY, RunDir

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

    def has_gap(self, row: dict) -> bool:
        """Whether the eval row measured a setting other than the run's own."""
        return any(k.startswith(names.name(names.PERPLEXITY) + "@") for k in row)

    def name(self, metric: str, setting: str) -> str:
        solve = Solve.parse(setting, "setting")  # '6': an N of the run's own solver
        return names.name(metric, solve.relative(self.solver, self.num_steps).suffix)


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
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON row ({e.msg} at column {e.colno}; "
                             "a line cut short by a killed write?)") from None
        if own in row:
            rows.setdefault(row["step"], {}).update(row)
        if SPEED in row:
            train.append(row)
    for step, row in rows.items():
        speeds = [r[SPEED] for r in train if r["step"] <= step]
        row["tokens_per_second"] = statistics.median(speeds) if speeds else float("nan")
    return [rows[s] for s in sorted(rows)]


def read_run(run_dir: str, *, discrete_ok: bool = False) -> Run:
    """The run's eval rows, and its own solver and N from its ``model_config.json``; a run
    with no eval yet, or an ODE run whose evals measured no other setting, has no gap to
    show. ``discrete_ok`` (the table): a discrete baseline (sequential, parallel) is its own
    figure alone, at its depth (``num_layers``), beside the ODE runs it is compared with."""
    rows = eval_rows(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: no eval in its metrics yet (the run stopped before its "
                         "first eval?)")
    config = RunDir(run_dir).model_config()
    discrete = config.architecture != "ode"
    run = Run(rows, config.solver, config.num_layers if discrete else config.num_steps)
    if discrete and discrete_ok:
        return run
    if not any(run.has_gap(row) for row in rows):
        raise ValueError(f"{run_dir}: no depth-gap metrics (its evals measured only its own "
                         "solver and N: set TrainConfig.eval_solves)")
    return run


def _cell(cell: dict | None, mark_own: bool = False) -> str:
    """``{"perplexity", "gap"}`` as a table writes it: ``97.8 (+1.6 %)``, the own N bold, a
    perplexity of 1000 or more without its gap; ``–`` where the run has no figure."""
    if cell is None or cell.get("perplexity") is None:
        return "–"
    value, gap = cell["perplexity"], cell.get("gap")
    text = f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"
    if mark_own:
        return f"**{text}**"
    if value >= 1000 or gap is None:
        return text
    return f"{text} ({100 * gap:+.1f} %)"


def table_data(runs: list[tuple[str, str, int | None]]) -> list[dict]:
    """One record per run (its last eval, or the named step): its label, step, own solver
    and N, tokens/s, and per setting (an N of its own solver, or ``SOLVES``) the perplexity
    and its gap to the own N (the adaptive solve with its mean NFE). What ``--json`` writes
    and ``format_table`` prints."""
    records = []
    for name, run_dir, step in runs:
        run = read_run(run_dir, discrete_ok=True)
        row = run.rows[-1] if step is None else next(
            (r for r in run.rows if r["step"] == step), None)
        if row is None:
            raise ValueError(f"{run_dir}: no eval at step {step}")
        own = row[names.name(names.PERPLEXITY)]
        cells: dict[str, dict | None] = {}
        for setting in (*map(str, NS), *SOLVES):
            ppl = run.ppl(row, setting)
            cells[setting] = None if ppl is None else {"perplexity": ppl,
                                                       "gap": ppl / own - 1}
        nfe = row.get(run.name(names.NFE, SOLVES[1]))
        if cells[SOLVES[1]] is not None and nfe is not None:
            cells[SOLVES[1]]["nfe"] = nfe
        speed = row.get("tokens_per_second")
        records.append({"label": name, "run_dir": run_dir, "step": row["step"],
                        "solver": run.solver, "num_steps": run.num_steps,
                        "tokens_per_second": None if speed != speed else speed,
                        "cells": cells, "run_provenance": run_provenance(run_dir)})
    return records


def run_provenance(run_dir: str) -> dict | None:
    """Where the run itself was trained (its ``summary.json``: command, commit, date,
    machine); None for a run from before it was written, or one still training."""
    path = Path(RunDir(run_dir).file(SUMMARY))
    try:
        return json.loads(path.read_text()).get("provenance")
    except (OSError, ValueError, AttributeError):
        return None


def _mean_cell(cell: dict | None, own: bool) -> str:
    """A group mean as ``_cell`` writes a run's figure; the own N with its standard error."""
    if not own or cell is None or cell.get("se") is None:
        return _cell(cell, own)
    return f"**{cell['perplexity']:.1f} ± {cell['se']:.2f}**"


def _paired_cell(cell: dict | None) -> str:
    """``+0.69 ± 0.25 (+0.7 %)``: the mean paired difference, its standard error, and the
    mean relative difference; a difference of 1000 or more without decimals or bracket."""
    if cell is None:
        return "–"
    diff, se = cell["difference"], cell.get("se")
    if abs(diff) >= 1000:
        return f"{diff:+,.0f}"
    text = f"{diff:+.2f}" + ("" if se is None else f" ± {se:.2f}")
    return f"{text} ({100 * cell['relative']:+.1f} %)"


def _summary_row(row: dict) -> list[str]:
    """The N, RK4 and adaptive cells of a seed group's mean or paired-difference row."""
    cells = row["cells"]
    settings = [*map(str, NS), *SOLVES]
    if row["kind"] == "paired":
        return [_paired_cell(cells.get(s)) for s in settings]
    out = [_mean_cell(cells.get(s), s == str(row["num_steps"])) for s in settings]
    ada = cells.get(SOLVES[1])
    if ada and ada.get("nfe") is not None and out[-1].endswith(")"):
        out[-1] = f"{out[-1][:-1]}, {ada['nfe']:.0f})"
    return out


def format_table(records: list[dict], speed: bool = True,
                 summary: list[dict] | None = None) -> str:
    """Markdown: one row per record of ``table_data``, then the rows of ``summary`` (seed
    groups' means and paired differences, ``analysis.seeds.summarise``). The N columns are
    each run's own solver, named in the header when the runs share it, else after each
    name; ``speed``: the tok/s column (the median logged throughput, which on a shared host
    measures the load more than the run)."""
    solvers = {r["solver"] for r in records}
    own = f"{solver_label(solvers.pop())} " if len(solvers) == 1 else ""
    tail = " tok/s |" if speed else ""
    head = ("| recipe | step | " + " | ".join(f"{own}N={n}" for n in NS)
            + " | RK4 N=8 | adaptive 1e-3 (NFE) |" + tail)
    lines = [head, "|---|---:|" + "---:|" * (len(NS) + 2 + speed)]
    for r in records:
        cells = r["cells"]
        row = [_cell(cells.get(str(n)), n == r["num_steps"]) for n in NS]
        row.append(_cell(cells.get(SOLVES[0])))
        ada_cell = cells.get(SOLVES[1])
        ada = _cell(ada_cell)
        if ada_cell and ada_cell.get("nfe") is not None and ada.endswith(")"):
            ada = f"{ada[:-1]}, {ada_cell['nfe']:.0f})"
        row.append(ada)
        if speed:
            tok = r.get("tokens_per_second")
            row.append("–" if tok is None else f"{tok / 1e3:.2f}k")
        label = r["label"] if own else f"{r['label']} ({solver_label(r['solver'])})"
        lines.append(f"| {label} | {r['step']} | " + " | ".join(row) + " |")
    for s in summary or ():
        row = _summary_row(s) + (["–"] if speed else [])
        step = "–" if s["step"] is None else s["step"]
        lines.append(f"| *{s['label']}* | {step} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def table(runs: list[tuple[str, str, int | None]], baseline: str | None = None) -> str:
    """Markdown: one row per run (its last eval, or the named step), and with ``baseline``
    the seed groups' means and paired differences to it."""
    records = table_data(runs)
    return format_table(records, summary=summary_rows(records, baseline))


def summary_rows(records: list[dict], baseline: str | None) -> list[dict] | None:
    """The seed-group rows of ``--baseline`` (None without one)."""
    if baseline is None:
        return None
    from ode_lm.analysis.seeds import summarise

    return summarise(records, baseline)


def plot(runs: list[tuple[str, str, int | None]], out: str) -> str:
    """Gap (%) against the run's own N versus training step: RK4 N=8, adaptive, the run's
    own solver at N=4 and N=24 (left), and at N=3 (right, its own scale); returns the file
    written (a PNG when `out` has no suffix)."""
    read = [(name, read_run(run_dir)) for name, run_dir, _ in runs]  # each refused before
    import matplotlib  # any drawing: a run without gap metrics writes no file

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax3) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"rk4:steps=8": "-", "adaptive:rtol=0.001": "--", "4": ":", "24": "-."}
    for i, (name, run) in enumerate(read):
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
    if not Path(out).suffix:  # matplotlib would add its default one: say the name it gets
        out = f"{out}.png"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


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
    p.add_argument("--json", default=None,
                   help="table: also write its figures and their provenance to this JSON file")
    p.add_argument("--baseline", default=None, metavar="GROUP",
                   help="table: runs are named 'GROUP, seed S'; add each group's mean and "
                        "each other group's paired difference to GROUP")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm depth-gap") -> int:
    parser = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.what == "plot" and not args.out:
        parser.error("plot needs --out")
    if args.what == "plot" and args.baseline is not None:
        parser.error("--baseline is a table option (plot draws each run)")
    return cli.run_command(prog, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    # where the results go, before any run is read (the plot's directory is made for it)
    if args.out and os.path.isdir(args.out):
        raise IsADirectoryError(f"--out={args.out}: is a directory, not a file")
    if args.json:
        cli.check_out_file(args.json)
    if args.what == "table":
        records = table_data(args.runs)
        summary = summary_rows(records, args.baseline)
        print(format_table(records, summary=summary))
        if args.json:
            from ode_lm.provenance import provenance

            data = {"provenance": provenance(["depth-gap", *args.argv]), "runs": records}
            if summary is not None:
                data["summary"] = summary
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
            print(f"wrote {args.json}")
    else:
        print(f"wrote {plot(args.runs, args.out)}")
    return 0
