"""Depth report: validation perplexity of a trained run at every N and solver.

  ode-lm depth-report --model_dir=RUN [--compare_dir=RUN2] --out=DIR [--json=FILE]
      [--baselines=DIR,...]

Evaluates Euler, midpoint and RK4 at N ∈ {2, 3, 4, 6, 8, 12, 16, 24} and the adaptive
Bogacki–Shampine solver at two tolerances (with its mean NFE per batch) on the run's
validation split (the DataConfig of MODEL_DIR/data_config.json, so ``eval_max_batches``
applies), plus the W(t) smoothness figure. Writes DIR/depth_report.{json,csv,png}; ``--json`` also
writes the JSON to FILE. JSON: {"trained_num_steps", "reference": {"solver", "num_steps",
"ppl"} (the run's own solve, what the PNG's relative panel divides by), "ppl": {solver:
{"N": ppl}}, "adaptive": [{"rtol", "ppl", "nfe"}], "smoothness", ...} and, with
--compare_dir, the same under "compare".

--baselines=DIR,... adds the quality–compute frontier: each dedicated discrete baseline run
(e.g. configs/runs/baseline_demo.gin at several LAYERS) evaluated once on its own
validation split, and DIR/frontier.{csv,png}: perplexity against NFE and against forward
FLOPs per token for every N and solver of the ODE run(s) and each baseline as a point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from ode_lm import cli
from ode_lm.provenance import provenance


def build_parser(prog: str = "ode-lm depth-report") -> argparse.ArgumentParser:
    from ode_lm.analysis.depth import DEFAULT_NUM_STEPS, DEFAULT_RTOLS, DEFAULT_SOLVERS

    p = cli.doc_parser(prog, __doc__)
    p.add_argument("--model_dir", required=True, help="a training run directory")
    p.add_argument("--compare_dir", default=None, help="a second run to overlay")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--num_steps", type=cli.int_list, default=list(DEFAULT_NUM_STEPS))
    p.add_argument("--solvers", default=",".join(DEFAULT_SOLVERS),
                   help="fixed-grid solvers, comma-separated")
    p.add_argument("--rtols", type=cli.float_list, default=list(DEFAULT_RTOLS),
                   help="adaptive solver tolerances")
    p.add_argument("--atol", type=float, default=None, help="adaptive atol (default: config)")
    p.add_argument("--baselines", default=None,
                   help="discrete baseline run dirs, comma-separated: the frontier files")
    return p


def _flop_coefficients(run) -> dict[str, float]:
    """The run's FLOPs-per-token coefficients at its eval batch (``analysis.frontier``)."""
    from ode_lm.analysis.frontier import flop_coefficients

    data = run.data_config
    return flop_coefficients(run.config, data.seq_len,
                             data.eval_global_batch_size * data.seq_len)


def report_baseline(model_dir: str, args, log) -> dict:
    """One discrete baseline at its own depth: ppl, NFE (= its layers) and FLOP coefficients."""
    from ode_lm.training.saved_run import load_run

    run = load_run(model_dir, None)
    config = run.config
    if config.architecture == "ode":
        raise ValueError(f"--baselines={model_dir}: an ODE run, not a discrete baseline "
                         "(give it as --model_dir or --compare_dir)")
    res = run.evaluate()
    log(f"== {model_dir} (step {run.step}): {config.architecture} L={config.num_layers} "
        f"ppl {res.perplexity:.2f}")
    return {"model_dir": model_dir, "step": run.step, "architecture": config.architecture,
            "num_layers": config.num_layers, "ppl": res.perplexity, "nfe": res.nfe,
            "flop_coefficients": _flop_coefficients(run)}


def report_run(model_dir: str, args, log) -> dict:
    from ode_lm.analysis import depth
    from ode_lm.models.solve import Solve
    from ode_lm.training.saved_run import load_run

    run = load_run(model_dir, args.step)
    log(f"== {model_dir} (step {run.step})")
    curve = depth.depth_curve(run.evaluate, num_steps=args.num_steps,
                              solvers=args.solvers.split(","), rtols=args.rtols,
                              atol=args.atol, log=log)
    model = run.model()
    if run.config.architecture != "ode":
        raise ValueError(f"--model_dir={model_dir}: architecture "
                         f"{run.config.architecture!r} has no continuous depth")
    trained_n, solver = run.config.num_steps, run.config.solver
    ref = curve["ppl"].get(solver, {}).get(str(trained_n))
    if ref is None:  # the relative panel's reference, also when --num_steps leaves it out
        ref = run.evaluate(Solve(solver, trained_n)).perplexity
    smooth = depth.weight_smoothness(model.weights_at)
    log(f"smoothness max_t ‖W(t+δ)−W(t)‖/(δ‖W(t)‖) = {smooth['max']:.4g} ({smooth['argmax']})")
    return {"model_dir": model_dir, "step": run.step,
            "trained_num_steps": trained_n,
            "reference": {"solver": solver, "num_steps": trained_n, "ppl": ref}, **curve,
            "flop_coefficients": _flop_coefficients(run),
            "smoothness": smooth["max"], "smoothness_detail": smooth}


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm depth-report") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv  # for the JSON's provenance
    cli.setup_logging()
    return cli.run_command(prog, lambda: run(args))


def run(args: argparse.Namespace) -> int:

    t0 = time.time()
    if min(args.num_steps) < 1:
        raise cli.UsageError(f"--num_steps={','.join(map(str, args.num_steps))}: every entry "
                             "must be >= 1")
    if min(args.rtols) <= 0:
        raise cli.UsageError(f"--rtols={','.join(map(str, args.rtols))}: every tolerance "
                             "must be > 0")
    for s in args.solvers.split(","):
        cli.check_solver_flags(s, None, args.atol, flag="--solvers")
    baseline_dirs = [d for d in (args.baselines or "").split(",") if d]
    if args.baselines is not None and not baseline_dirs:
        raise cli.UsageError(f"--baselines={args.baselines!r}: expected DIR,... (run "
                             "directories)")
    cli.check_out_dir(args.out)  # the outputs' places, before minutes of evaluation
    if args.json:
        cli.check_out_file(args.json)
    for flag, d in (("--model_dir", args.model_dir), ("--compare_dir", args.compare_dir),
                    *(("--baselines", b) for b in baseline_dirs)):
        if d is not None and not os.path.isdir(d):
            raise FileNotFoundError(f"{flag}={d}: no such directory")
    from ode_lm.analysis import depth

    result = report_run(args.model_dir, args, print)
    reports = {os.path.basename(os.path.normpath(args.model_dir)): result}
    if args.compare_dir:
        result["compare"] = report_run(args.compare_dir, args, print)
        name = os.path.basename(os.path.normpath(args.compare_dir))
        reports[name if name not in reports else f"{name} (compare)"] = result["compare"]
    baselines = {}
    for d in baseline_dirs:
        name = os.path.basename(os.path.normpath(d))
        baselines[name if name not in baselines else d] = report_baseline(d, args, print)
    if baselines:
        result["baselines"] = baselines
    result["provenance"] = provenance(["depth-report", *getattr(args, "argv", sys.argv[1:])])
    os.makedirs(args.out, exist_ok=True)
    text = json.dumps(result, indent=1)
    paths = [os.path.join(args.out, "depth_report.json")]
    with open(paths[0], "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
        paths.append(args.json)
    paths.append(str(depth.write_csv(reports, os.path.join(args.out, "depth_report.csv"))))
    paths.append(str(depth.plot_depth_curves(reports,
                                             os.path.join(args.out, "depth_report.png"))))
    if baselines:
        from ode_lm.analysis import frontier

        points = frontier.frontier_points(reports, baselines)
        paths.append(str(frontier.write_frontier_csv(points,
                                                     os.path.join(args.out, "frontier.csv"))))
        paths.append(str(frontier.plot_frontier(points, os.path.join(args.out, "frontier.png"))))
        print(_frontier_table(points))
    print(_table(reports))
    print(f"wrote {', '.join(paths)} in {time.time() - t0:.0f}s")
    return 0


def _table(reports: dict) -> str:
    """Markdown table: one row per (run, solver), one column per N, then the adaptive runs."""
    lines = []
    for run, rep in reports.items():
        ns = sorted({int(n) for row in rep["ppl"].values() for n in row})
        lines.append(f"\n{run} (trained N={rep['trained_num_steps']}, smoothness "
                     f"{rep['smoothness']:.3g})")
        lines.append("| solver \\ N | " + " | ".join(map(str, ns)) + " |")
        lines.append("|---|" + "---:|" * len(ns))
        for solver, row in rep["ppl"].items():
            lines.append(f"| {solver} | " + " | ".join(f"{row[str(n)]:.1f}" for n in ns) + " |")
        for a in rep["adaptive"]:  # one value, not one per N: the rest of the row blank
            lines.append(f"| adaptive rtol={a['rtol']:g}: ppl {a['ppl']:.1f}, "
                         f"NFE {a['nfe']:.1f} |" + " |" * len(ns))
    return "\n".join(lines)



def _frontier_table(points: list[dict]) -> str:
    """Markdown: the baselines against the ODE run's Euler at the same NFE (N = L)."""
    runs = list(dict.fromkeys(p["run"] for p in points if p["kind"] == "ode"))
    lines = ["\n| L (= N) | baseline ppl | " + " | ".join(f"{r} (Euler)" for r in runs) + " |"]
    lines.append("|---:|---:|" + "---:|" * len(runs))
    for b in sorted((p for p in points if p["kind"] == "baseline"), key=lambda p: p["layers"]):
        cells = []
        for run in runs:
            match = [p["perplexity"] for p in points if p["run"] == run
                     and p["solver"] == "euler" and p["num_steps"] == b["layers"]]
            cells.append(f"{match[0]:.1f}" if match else "–")
        lines.append(f"| {b['layers']} | {b['perplexity']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
