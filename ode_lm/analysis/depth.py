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

DEFAULT_NUM_STEPS = (2, 3, 4, 6, 8, 12, 16, 24)
DEFAULT_SOLVERS = ("euler", "midpoint", "rk4")
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
    "ppl", "nfe"}]} from ``evaluate(num_steps, solver, rtol=, atol=) -> EvalResult``."""
    from ode_lm.training.metrics import Progress

    ppl: dict[str, dict[str, float]] = {}
    nfe: dict[str, dict[str, float]] = {}
    progress = Progress("depth report", len(solvers) * len(num_steps) + len(rtols),
                        unit="evaluations")
    for solver in solvers:
        ppl[solver], nfe[solver] = {}, {}
        for n in num_steps:
            res = evaluate(n, solver)
            ppl[solver][str(n)], nfe[solver][str(n)] = res.perplexity, res.nfe
            log(f"{solver:>8} N={n:<3d} ppl {res.perplexity:10.2f}")
            progress.update(progress.done_items + 1)
    adaptive = []
    for rtol in rtols:
        res = evaluate(None, adaptive_solver, rtol=rtol, atol=atol)
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


def plot_depth_curves(reports: dict[str, dict[str, Any]], path) -> pathlib.Path:
    """Perplexity against N on log axes: one line per solver, runs overlaid (solid, dashed);
    the adaptive solver's perplexity as a dotted level per tolerance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(path)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    colors = {"euler": "C0", "midpoint": "C1", "rk4": "C2"}
    for i, (run, rep) in enumerate(reports.items()):
        style = ("-", "--", ":", "-.")[i % 4]
        for solver, row in rep["ppl"].items():
            xs = sorted(int(n) for n in row)
            ax.plot(xs, [row[str(n)] for n in xs], style, marker="o", ms=3,
                    color=colors.get(solver), label=f"{run}: {solver}")
        if rep.get("trained_num_steps"):
            ax.axvline(rep["trained_num_steps"], color="grey", lw=0.5)
        for j, a in enumerate(rep["adaptive"]):
            ax.axhline(a["ppl"], ls=":", lw=1, color=f"C{3 + 2 * i + j}",
                       label=f"{run}: adaptive rtol={a['rtol']:g} (NFE {a['nfe']:.0f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted({int(n) for rep in reports.values() for row in rep["ppl"].values()
                    for n in row})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("solver steps N")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Depth curve: perplexity against the number of ODE steps")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
