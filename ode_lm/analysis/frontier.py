"""The quality–compute frontier: one ODE run at every N and solver against dedicated discrete
baselines (a sequential L-layer model per budget), perplexity against compute.

Compute is counted two ways: NFE (vector-field evaluations per token = blocks run; a
baseline's is its L) and forward FLOPs per token (``models.accounting.flops_per_token``).
Both are linear in the evaluations, ``flops = head + nfe · per_evaluation`` (weight
generation spread over the eval batch's tokens is in ``per_evaluation``), so a report keeps
the two coefficients (``flop_coefficients``) and every point, the adaptive solver's mean NFE
included, is priced the same way. ``ode-lm depth-report --baselines`` is the CLI.
"""

from __future__ import annotations

import csv
import pathlib
from collections.abc import Sequence
from typing import Any

from ode_lm.analysis.depth import RUN_MARKERS, SOLVER_COLORS, value_ticks

CSV_FIELDS = ("run", "kind", "solver", "num_steps", "rtol", "layers", "nfe",
              "flops_per_token", "perplexity", "frontier_nfe", "frontier_flops")


def flop_coefficients(config: Any, seq_len: int, tokens_per_batch: int) -> dict[str, float]:
    """``{"head", "per_evaluation"}``: forward FLOPs per token = head + NFE · per_evaluation,
    for an ODE model (its weight generation shared by ``tokens_per_batch`` tokens) or a
    discrete one (per layer)."""
    from ode_lm.models.accounting import flops_per_token

    if config.architecture == "ode":
        one = flops_per_token(config, 1, solver="euler", seq_len=seq_len,
                              tokens_per_batch=tokens_per_batch)
        return {"head": one.head_forward, "per_evaluation": one.forward - one.head_forward}
    f = flops_per_token(config, seq_len=seq_len, tokens_per_batch=tokens_per_batch)
    return {"head": f.head_forward, "per_evaluation": (f.forward - f.head_forward) / f.evaluations}


def _flops(coefficients: dict[str, float], nfe: float) -> float:
    return coefficients["head"] + nfe * coefficients["per_evaluation"]


def frontier_points(reports: dict[str, dict[str, Any]],
                    baselines: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every (run, solver, N), (run, adaptive rtol) and baseline as a row of ``CSV_FIELDS``;
    ``frontier_nfe`` (``frontier_flops``): no other point has at most its NFE (FLOPs per
    token) and a lower perplexity."""
    points: list[dict[str, Any]] = []
    for run, rep in reports.items():
        coef = rep["flop_coefficients"]
        for solver, row in rep["ppl"].items():
            for n, ppl in sorted(row.items(), key=lambda kv: int(kv[0])):
                nfe = rep["nfe"][solver][n]
                points.append({"run": run, "kind": "ode", "solver": solver, "num_steps": int(n),
                               "rtol": None, "layers": None, "nfe": nfe,
                               "flops_per_token": _flops(coef, nfe), "perplexity": ppl})
        for a in rep["adaptive"]:
            points.append({"run": run, "kind": "ode", "solver": "adaptive", "num_steps": None,
                           "rtol": a["rtol"], "layers": None, "nfe": a["nfe"],
                           "flops_per_token": _flops(coef, a["nfe"]), "perplexity": a["ppl"]})
    for run, base in baselines.items():
        points.append({"run": run, "kind": "baseline", "solver": None, "num_steps": None,
                       "rtol": None, "layers": base["num_layers"], "nfe": base["nfe"],
                       "flops_per_token": _flops(base["flop_coefficients"], base["nfe"]),
                       "perplexity": base["ppl"]})
    for key in ("nfe", "flops"):
        cost = "nfe" if key == "nfe" else "flops_per_token"
        for p in points:
            p[f"frontier_{key}"] = not any(
                q[cost] <= p[cost] and q["perplexity"] < p["perplexity"] for q in points)
    return points


def write_frontier_csv(points: Sequence[dict[str, Any]], path) -> pathlib.Path:
    """One row per point (``CSV_FIELDS``; empty where a field does not apply)."""
    path = pathlib.Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for p in points:
            w.writerow(["" if p[k] is None else (f"{p[k]:.6g}" if isinstance(p[k], float)
                                                 else p[k]) for k in CSV_FIELDS])
    return path


def _compact(value: float, _pos: Any = None) -> str:
    """A tick label: 2, 50, 20k, 1.5M, 3G."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def plot_frontier(points: Sequence[dict[str, Any]], path) -> pathlib.Path:
    """Perplexity against NFE (left) and forward FLOPs per token (right), log x: each ODE
    run's solvers as lines over N (colour = solver, marker = run), the adaptive solver as
    points, the baselines as black stars joined in order of L, and the frontier (no point
    cheaper and better) as a thick grey step line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    path = pathlib.Path(path)
    runs = list(dict.fromkeys(p["run"] for p in points if p["kind"] == "ode"))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.2), sharey=True)
    for ax, key, front_key, xlabel in (
            (axes[0], "nfe", "frontier_nfe", "NFE per token (blocks run; a baseline's = L)"),
            (axes[1], "flops_per_token", "frontier_flops", "forward FLOPs per token")):
        for i, run in enumerate(runs):
            mine = [p for p in points if p["run"] == run]
            for solver in dict.fromkeys(p["solver"] for p in mine):
                pts = sorted((p for p in mine if p["solver"] == solver), key=lambda p: p[key])
                ls = "none" if solver == "adaptive" else "-"
                ax.plot([p[key] for p in pts], [p["perplexity"] for p in pts], ls=ls,
                        marker=RUN_MARKERS[i % len(RUN_MARKERS)], ms=5, lw=1.2,
                        color=SOLVER_COLORS.get(solver), label=f"{run}: {solver}")
                for p in pts if solver == "euler" else ():  # N, to compare with L
                    ax.annotate(f"N={p['num_steps']}", (p[key], p["perplexity"]),
                                textcoords="offset points", xytext=(4, -10), fontsize=6,
                                color=SOLVER_COLORS.get(solver))
        base = sorted((p for p in points if p["kind"] == "baseline"), key=lambda p: p["layers"])
        if base:
            ax.plot([p[key] for p in base], [p["perplexity"] for p in base], "k--*", ms=11,
                    lw=1, label="sequential baselines (L layers)")
            for p in base:
                ax.annotate(f"L={p['layers']}", (p[key], p["perplexity"]),
                            textcoords="offset points", xytext=(5, 5), fontsize=8)
        front = sorted((p for p in points if p[front_key]), key=lambda p: p[key])
        ax.step([p[key] for p in front], [p["perplexity"] for p in front], where="post",
                color="grey", lw=6, alpha=0.25, label="frontier (nothing cheaper is better)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(_compact))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    value_ticks(axes[0], [p["perplexity"] for p in points])
    axes[0].set_ylabel("validation perplexity")
    axes[0].set_title("quality against evaluations")
    axes[1].set_title("quality against compute")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
