"""The three analyses as reports: a model and its inputs → files in an output dir and the
summary lines that describe them.

``ode-lm analyze`` (``commands/analyze.py``) parses flags, restores the run's model and
tokenizer, and calls these; tests call them directly on a model built in the test.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np

from ode_lm.analysis import model_access, plots, report_html
from ode_lm.analysis.spectra import Spectra, random_hidden_units, summary_lines
from ode_lm.analysis.trajectory import states_at, trajectory


def run_spectral(model, out_dir, *, times: Sequence[float] | None = None,
                 mlp_units: int | None = None, seed: int = 0, compare=None,
                 label: str = "") -> tuple[Spectra, list[str]]:
    """Eigenvalues → spectra.npz (+ spectra_compare.npz) and the PNGs; returns summary lines.

    ``compare``: another model (e.g. the vanilla baseline) analysed the same way and overlaid
    on normalised depth.
    """
    out = pathlib.Path(out_dir)
    units = random_hidden_units(model.config.hidden_dim, mlp_units, seed)
    spec = model_access.model_spectra(model, times, units, label)
    out.mkdir(parents=True, exist_ok=True)  # only once the inputs proved valid
    spec.save(out / "spectra.npz")
    specs = [spec]
    lines = [f"spectra of {spec.label}:"] + summary_lines(spec)
    if compare is not None:
        cunits = random_hidden_units(compare.config.hidden_dim, mlp_units, seed)
        other = model_access.model_spectra(compare, times, cunits)
        other.save(out / "spectra_compare.npz")
        specs.append(other)
        lines += [f"spectra of {other.label}:"] + summary_lines(other)
    paths = plots.plot_spectra(specs, out)
    lines.append("wrote " + ", ".join(p.name for p in [out / "spectra.npz", *paths]))
    return spec, lines


def run_lyapunov(model, tokens: np.ndarray, token_text: list[str], out_dir, *,
                 position: int = -1, num_steps: int | None = None, solver: str | None = None,
                 num_exponents: int | None = None, score: str = "max",
                 chunk_size: int | None = 64):
    """Token Lyapunov spectra → lyapunov.npz, lyapunov.html, lyapunov_heatmap.png."""
    if score not in ("max", "sum"):
        raise ValueError(f"--score={score!r}: expected 'max' or 'sum'")
    out = pathlib.Path(out_dir)
    res = model_access.model_lyapunov(model, tokens, position=position, num_steps=num_steps,
                                      solver=solver, num_exponents=num_exponents,
                                      chunk_size=chunk_size)
    out.mkdir(parents=True, exist_ok=True)
    res.token_text = list(token_text)
    res.save(out / "lyapunov.npz")
    other = "sum" if score == "max" else "max"
    report_html.lyapunov_html(
        token_text, res.score(score), out / "lyapunov.html", position=res.position,
        score_name=f"{score} exponent" if score == "max" else "sum of exponents",
        extra=res.score(other), extra_name=f"{other} exponent" if other == "max"
        else "sum of exponents",
    )
    plots.plot_lyapunov_heatmap(res.exponents, out / "lyapunov_heatmap.png", token_text,
                                res.position)
    lines = [f"Lyapunov exponents of position {res.position} ({token_text[res.position]!r}), "
             f"{res.solver} x {res.num_steps} steps, {res.exponents.shape[1]} exponents/token",
             f"top-5 sensitive tokens ({score} exponent):"]
    for i, s in res.top_tokens(5, score):
        lines.append(f"  #{i:<4d} {token_text[i]!r:<20} {s:.4g}")
    lines.append("wrote lyapunov.npz, lyapunov.html, lyapunov_heatmap.png")
    return res, lines


def run_trajectory(model, tokens: np.ndarray, out_dir, *, num_steps: int | None = None,
                   solver: str | None = None, times: Sequence[float] | None = None):
    """Hidden states → trajectory.npz and trajectory.png (norm and speed against depth)."""
    out = pathlib.Path(out_dir)
    if times is not None:
        max_dt = None if num_steps is None else 1.0 / num_steps
        traj = states_at(model, tokens, times, max_dt=max_dt, solver=solver)
    else:
        traj = trajectory(model, tokens, num_steps, solver)
    out.mkdir(parents=True, exist_ok=True)
    traj.save(out / "trajectory.npz")
    plots.plot_trajectory(traj.states, traj.times, out / "trajectory.png")
    norms = np.linalg.norm(traj.states, axis=-1).mean(-1)
    lines = [f"trajectory: {len(traj.times)} states ({traj.solver}, {traj.num_steps} steps), "
             f"{traj.states.shape[1]} tokens, width {traj.states.shape[2]}",
             "mean ‖x(t)‖: " + "  ".join(f"t={t:.3g}:{n:.3g}"
                                          for t, n in zip(traj.times, norms, strict=True)),
             "wrote trajectory.npz, trajectory.png"]
    return traj, lines


def write_summary(out_dir, command: str, lines: list[str]) -> pathlib.Path:
    """``<command>_summary.txt`` next to the outputs (what the CLI printed)."""
    path = pathlib.Path(out_dir) / f"{command}_summary.txt"
    path.write_text("\n".join(lines) + "\n")
    return path
