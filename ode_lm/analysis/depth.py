"""Depth curves: is a trained DiffEqFormer a continuous-depth model?

``depth_curve`` evaluates one run's validation perplexity for fixed-grid solvers over a range
of step counts N and for the adaptive solver at several tolerances (with its mean NFE);
``weight_smoothness`` measures how fast the generated weights move in t,
max over t and matrices of ‖W(t+δ) − W(t)‖ / (δ·‖W(t)‖): O(1) for W(t) that is smooth on
[0, 1], O(time_scale) for the paper's sin(1000·t·ω) features. ``ode-lm depth-report`` is
the CLI; ``write_csv``/``plot_depth_curves`` write its files.
"""

from __future__ import annotations

import csv
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ode_lm.models.config import SOLVERS

DEFAULT_NUM_STEPS = (2, 3, 4, 6, 8, 12, 16, 24)
DEFAULT_SOLVERS = SOLVERS  # every fixed-grid solver
DEFAULT_RTOLS = (1e-2, 1e-3)


def weight_smoothness(weights_at: Callable[[jax.Array], dict], *, num_times: int = 257,
                      delta: float = 1e-3, chunk: int = 16) -> dict[str, Any]:
    """max over t ∈ [0, 1−δ] (``num_times`` points) of ‖W(t+δ) − W(t)‖_F / (δ·‖W(t)‖_F) for
    every generated kernel (``*_kernel``), and the max over kernels.

    ``weights_at(t [K]) -> {name: [K, ...]}``. Float32 differences over δ = 1e-3 resolve
    relative rates down to ~1e-4 (1e-7 / δ), far below any rate of interest here."""
    times = np.linspace(0.0, 1.0 - delta, num_times, dtype=np.float32)
    per_weight: dict[str, float] = {}
    fn = jax.jit(lambda t: _relative_rates(weights_at, t, delta))
    for start in range(0, num_times, chunk):
        t = jnp.asarray(times[start:start + chunk])
        for name, rate in fn(t).items():
            per_weight[name] = max(per_weight.get(name, 0.0), float(jnp.max(rate)))
    if not per_weight:
        raise ValueError("weight_smoothness: the model generates no kernels")
    worst = max(per_weight, key=per_weight.get)
    return {"max": per_weight[worst], "argmax": worst, "per_weight": per_weight,
            "delta": delta, "num_times": num_times}


def _relative_rates(weights_at, t, delta):
    w0, w1 = weights_at(t), weights_at(t + delta)
    out = {}
    for name in w0:
        if not name.endswith("_kernel"):
            continue
        axes = tuple(range(1, w0[name].ndim))
        diff = jnp.sqrt(jnp.sum(jnp.square(w1[name] - w0[name]), axis=axes))
        norm = jnp.sqrt(jnp.sum(jnp.square(w0[name]), axis=axes))
        out[name] = diff / (delta * jnp.maximum(norm, 1e-30))
    return out


def depth_curve(evaluate: Callable[..., Any], *, num_steps: Sequence[int] = DEFAULT_NUM_STEPS,
                solvers: Sequence[str] = DEFAULT_SOLVERS, rtols: Sequence[float] = DEFAULT_RTOLS,
                adaptive_solver: str = "adaptive", atol: float | None = None,
                log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """{"ppl": {solver: {"N": ppl}}, "nfe": {solver: {"N": nfe}}, "adaptive": [{"rtol",
    "ppl", "nfe"}]} from ``evaluate(solve: models.solve.Solve) -> EvalResult``."""
    from ode_lm.models.solve import Solve
    from ode_lm.training.metrics import Progress

    ppl: dict[str, dict[str, float]] = {}
    nfe: dict[str, dict[str, float]] = {}
    progress = Progress("depth report", len(solvers) * len(num_steps) + len(rtols),
                        unit="evaluations")
    for solver in solvers:
        ppl[solver], nfe[solver] = {}, {}
        for n in num_steps:
            res = evaluate(Solve(solver, n))
            ppl[solver][str(n)], nfe[solver][str(n)] = res.perplexity, res.nfe
            log(f"{solver:>8} N={n:<3d} ppl {res.perplexity:10.2f}")
            progress.update(progress.done_items + 1)
    adaptive = []
    for rtol in rtols:
        res = evaluate(Solve(adaptive_solver, rtol=rtol, atol=atol))
        capped = getattr(res, "capped", 0.0)
        adaptive.append({"rtol": rtol, "ppl": res.perplexity, "nfe": res.nfe, "capped": capped})
        log(f"{adaptive_solver:>8} rtol={rtol:g} ppl {res.perplexity:10.2f} NFE {res.nfe:.1f}"
            + (f" (step cap hit on {100 * capped:.0f}% of batches)" if capped else ""))
        progress.update(progress.done_items + 1)
    progress.done()
    return {"ppl": ppl, "nfe": nfe, "adaptive": adaptive}


def write_csv(reports: dict[str, dict[str, Any]], path) -> pathlib.Path:
    """One row per (run, solver, N or rtol): perplexity and NFE."""
    path = pathlib.Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "solver", "num_steps", "rtol", "perplexity", "nfe"])
        for run, rep in reports.items():
            for solver, row in rep["ppl"].items():
                for n, value in row.items():
                    w.writerow([run, solver, n, "", f"{value:.6g}",
                                f"{rep['nfe'][solver][n]:.6g}"])
            for a in rep["adaptive"]:
                w.writerow([run, "adaptive", "", f"{a['rtol']:g}", f"{a['ppl']:.6g}",
                            f"{a['nfe']:.6g}"])
    return path


RUN_MARKERS = ("o", "s", "^", "D", "v", "P")
RUN_STYLES = ("-", "--", "-.", ":")
SOLVER_COLORS = {s: f"C{i}" for i, s in enumerate((*SOLVERS, "adaptive"))}


def reference_ppl(report: dict[str, Any]) -> float | None:
    """The run's perplexity at its trained solver and N (what the relative panel divides
    by): ``report["reference"]["ppl"]``, else its Euler curve at the trained N, else None."""
    ref = report.get("reference") or {}
    if ref.get("ppl") is not None:
        return float(ref["ppl"])
    value = report["ppl"].get("euler", {}).get(str(report.get("trained_num_steps")))
    return None if value is None else float(value)


def value_ticks(ax, values: Sequence[float]) -> None:
    """Labelled y ticks at the data's scale: a log axis with 1-2-5 ticks (plus 1.5, 3, 7
    when the data spans less than a decade) when the values span more than 3×, else linear."""
    from matplotlib import ticker

    lo, hi = min(values), max(values)
    if hi / lo <= 3:
        ax.yaxis.set_major_locator(ticker.MaxNLocator(8))
        return
    ax.set_yscale("log")
    subs = (1.0, 2.0, 5.0) if hi / lo > 100 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def plot_depth_curves(reports: dict[str, dict[str, Any]], path) -> pathlib.Path:
    """Two panels against N (log x): validation perplexity (labelled ticks at the data's
    scale), and the same relative to each run's trained N in % (a symlog axis, linear
    within ±5 %, so 1–2 % differences show next to a 25× blow-up). Colour = solver, marker
    and dash = run; the adaptive solver as points right of the grid, one column per rtol,
    annotated with their NFE; each run's trained N a vertical line named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    path = pathlib.Path(path)
    ns = sorted({int(n) for rep in reports.values() for row in rep["ppl"].values() for n in row})
    rtols = sorted({a["rtol"] for rep in reports.values() for a in rep["adaptive"]},
                   reverse=True)
    top = max(ns) if ns else 1
    x_adaptive = {r: top * 1.7 ** (k + 1) for k, r in enumerate(rtols)}
    fig, (ax, rel) = plt.subplots(2, 1, figsize=(11, 8.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    values, rel_values = [], []
    for i, (run, rep) in enumerate(reports.items()):
        marker, style = RUN_MARKERS[i % len(RUN_MARKERS)], RUN_STYLES[i % len(RUN_STYLES)]
        ref = reference_ppl(rep)
        for solver, row in rep["ppl"].items():
            xs = sorted(int(n) for n in row)
            ys = [row[str(n)] for n in xs]
            values += ys
            kw = {"color": SOLVER_COLORS.get(solver), "marker": marker, "ms": 5, "lw": 1.4}
            ax.plot(xs, ys, style, label=f"{run}: {solver}", **kw)
            if ref:
                pct = [100 * (y / ref - 1) for y in ys]
                rel_values += pct
                rel.plot(xs, pct, style, **kw)
        for a in rep["adaptive"]:
            x = x_adaptive[a["rtol"]]
            values.append(a["ppl"])
            kw = {"color": SOLVER_COLORS["adaptive"], "marker": marker, "ms": 7, "ls": "none",
                  "mfc": "white" if i else None}
            first = a is rep["adaptive"][0]
            ax.plot([x], [a["ppl"]], label=f"{run}: adaptive (NFE)" if first else None, **kw)
            ax.annotate(f"NFE {a['nfe']:.0f}", (x, a["ppl"]), textcoords="offset points",
                        xytext=(7, -3 + 9 * i), fontsize=7, color=SOLVER_COLORS["adaptive"])
            if ref:
                pct = 100 * (a["ppl"] / ref - 1)
                rel_values.append(pct)
                rel.plot([x], [pct], **kw)
                rel.annotate(f"{pct:+.1f}%", (x, pct), textcoords="offset points",
                             xytext=(7, -3 + 9 * i), fontsize=7, color=SOLVER_COLORS["adaptive"])
        n = rep.get("trained_num_steps")
        if n:
            solver = (rep.get("reference") or {}).get("solver") or "euler"
            for a_ in (ax, rel):
                a_.axvline(n, color="black", lw=1.0, ls=style, alpha=0.6,
                           label=f"{run}: trained N={n} ({solver})" if a_ is ax else None)
    ax.set_xscale("log")
    if values:
        value_ticks(ax, values)
    rel.set_yscale("symlog", linthresh=5.0, linscale=3.0)
    low = min(rel_values + [-1.0])
    high = max(rel_values + [5.0])
    rel.set_ylim(max(low, -50.0) * 1.3 - 0.5, high * (1.6 if high > 5 else 1.2))
    rel.set_yticks([t for t in (-50, -20, *range(-5, 6), 20, 100, 1000, 10000, 100000)
                    if low * 1.3 - 0.5 <= t <= high * 1.6])  # every 1 % in the linear part
    rel.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    rel.yaxis.set_minor_locator(ticker.NullLocator())
    rel.axhline(0, color="black", lw=0.6)
    ticks = ns + [x_adaptive[r] for r in rtols]
    rel.set_xticks(ticks)
    rel.set_xticklabels([str(n) for n in ns] + [f"adaptive\nrtol={r:g}" for r in rtols])
    rel.xaxis.set_minor_locator(ticker.NullLocator())
    if ticks:
        rel.set_xlim(min(ticks) / 1.25, max(ticks) * 1.6)
    rel.set_xlabel("solver steps N  (adaptive: its own steps; NFE = vector-field evaluations)")
    ax.set_ylabel("validation perplexity")
    rel.set_ylabel("vs the run's trained N  (%)")
    ax.set_title("Depth curve: perplexity against the number of ODE steps")
    for a_ in (ax, rel):
        a_.grid(alpha=0.3, which="major")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), handlelength=3.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
