"""PNG figures for spectra, Lyapunov exponents and trajectories (matplotlib, Agg backend).

Every function takes already-computed numpy results and a path, writes one PNG and returns
the path, so the figures can be regenerated from the ``.npz`` files alone.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ode_lm.analysis.spectra import KINDS, Spectra  # noqa: E402

TITLES = {"qk": "QK = W_Q W_Kᵀ", "ov": "OV = W_V W_O", "mlp": "MLP = W₁ W₂"}
BANDS = ((0.05, 0.95), (0.25, 0.75))


def _depth_axis(specs: Sequence[Spectra]) -> tuple[list[np.ndarray], str]:
    """x values per model: raw t / layer for a single model, normalised depth when mixed."""
    kinds = {s.depth_kind for s in specs}
    if kinds == {"t"}:
        return [np.asarray(s.depth, float) for s in specs], "depth t"
    if len(specs) == 1:
        return [np.asarray(specs[0].depth, float)], "layer"
    return [s.normalized_depth for s in specs], "depth (t, or (layer+1)/L for discrete models)"


def _label(spec: Spectra, i: int) -> str:
    return spec.label or f"model {i}"


def _save(fig, path) -> pathlib.Path:
    path = pathlib.Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_magnitude_bands(specs: Sequence[Spectra], path) -> pathlib.Path:
    """|λ| distribution against depth: median, 25–75 % and 5–95 % quantile bands, dashed max."""
    xs, xlabel = _depth_axis(specs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, name in zip(axes, KINDS, strict=False):
        for i, (spec, x) in enumerate(zip(specs, xs, strict=False)):
            color = f"C{i}"
            q = spec.magnitude_quantiles(name, [0.05, 0.25, 0.5, 0.75, 0.95])
            marker = "o" if spec.depth_kind == "layer" else None
            for (lo, hi), alpha in zip(((0, 4), (1, 3)), (0.15, 0.3), strict=False):
                ax.fill_between(x, q[lo], q[hi], color=color, alpha=alpha, lw=0)
            ax.plot(x, q[2], color=color, marker=marker, ms=3, label=f"{_label(spec, i)} median")
            ax.plot(x, spec.max_abs(name), color=color, ls="--", lw=1,
                    label=f"{_label(spec, i)} max")
        ax.set_yscale("log")  # magnitudes span orders of magnitude; the max would flatten bands
        _label_axes(ax, f"|λ| of {TITLES[name]}", xlabel, "|λ|  (log; bands: 5–95 %, 25–75 %)")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def plot_max_abs(specs: Sequence[Spectra], path) -> pathlib.Path:
    """max |λ| against depth, per head (thin) and over all heads (thick)."""
    xs, xlabel = _depth_axis(specs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, name in zip(axes, KINDS, strict=False):
        for i, (spec, x) in enumerate(zip(specs, xs, strict=False)):
            color = f"C{i}"
            if name != "mlp":
                ax.plot(x, spec.max_abs(name, per_head=True), color=color, lw=0.6, alpha=0.5)
            ax.plot(x, spec.max_abs(name), color=color, lw=2, label=_label(spec, i))
        per_head = " (thin: per head)" if name != "mlp" else ""
        _label_axes(ax, f"max |λ| of {TITLES[name]}{per_head}", xlabel, "max |λ|")
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_ov_positive_real(specs: Sequence[Spectra], path) -> pathlib.Path:
    """Fraction of OV eigenvalues with Re λ > 0 against depth (repulsive vs attractive)."""
    xs, xlabel = _depth_axis(specs)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (spec, x) in enumerate(zip(specs, xs, strict=False)):
        color = f"C{i}"
        ax.plot(x, spec.positive_real_fraction("ov", per_head=True), color=color, lw=0.6,
                alpha=0.5)
        ax.plot(x, spec.positive_real_fraction("ov"), color=color, lw=2, label=_label(spec, i))
    ax.axhline(0.5, color="gray", ls=":", lw=1)
    ax.set_ylim(-0.02, 1.02)
    _label_axes(ax, "OV regime: below 0.5 attractive (contracting), above repulsive", xlabel,
                "fraction of OV eigenvalues with Re λ > 0")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_complex_plane(spec: Spectra, path, points: Sequence[int] | None = None) -> pathlib.Path:
    """Eigenvalues in the complex plane at the first, middle and last depth point."""
    p = len(spec.depth)
    points = list(points) if points is not None else sorted({0, p // 2, p - 1})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    name = "t" if spec.depth_kind == "t" else "layer"
    for ax, kind in zip(axes, KINDS, strict=False):
        ev = spec.kind(kind)
        for c, i in enumerate(points):
            ax.scatter(ev[i].real, ev[i].imag, s=6, alpha=0.6, color=f"C{c}",
                       label=f"{name}={float(spec.depth[i]):g}")
        ax.axvline(0, color="gray", lw=0.8)
        ax.axhline(0, color="gray", lw=0.8)
        _label_axes(ax, f"eigenvalues of {TITLES[kind]}", "Re λ", "Im λ")
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_spectra(specs: Sequence[Spectra], out_dir, prefix: str = "spectra") -> list[pathlib.Path]:
    """All spectrum figures for one model (or several overlaid, e.g. ODE vs baseline)."""
    out = pathlib.Path(out_dir)
    paths = [
        plot_magnitude_bands(specs, out / f"{prefix}_magnitude.png"),
        plot_max_abs(specs, out / f"{prefix}_max_abs.png"),
        plot_ov_positive_real(specs, out / f"{prefix}_ov_positive_real.png"),
    ]
    for i, spec in enumerate(specs):
        suffix = "" if len(specs) == 1 else f"_{i}"
        paths.append(plot_complex_plane(spec, out / f"{prefix}_complex_plane{suffix}.png"))
    return paths


def _token_ticks(ax, token_text: Sequence[str] | None, n: int) -> None:
    if token_text is None:
        return
    step = max(1, int(np.ceil(n / 64)))
    idx = np.arange(0, n, step)
    ax.set_xticks(idx)
    ax.set_xticklabels([repr(token_text[i])[1:-1][:12] for i in idx], rotation=90, fontsize=6)


def _others(values: np.ndarray, position: int) -> np.ndarray:
    """Values of every token except the explained one (its self-block dominates)."""
    keep = np.ones(len(values), bool)
    keep[position] = False
    return values[keep] if keep.any() else values


def plot_lyapunov_heatmap(exponents: np.ndarray, path, token_text: Sequence[str] | None = None,
                          position: int | None = None) -> pathlib.Path:
    """Heatmap of exponent (rows, largest first) against input token (columns) + the score.

    The output token's own block (I + dt·J_jj) usually dwarfs the others, so the colour and
    bar ranges are set by the *other* tokens and the output token's column saturates (its
    value is written above its bar).
    """
    exponents = np.asarray(exponents)
    n, k = exponents.shape
    position = n - 1 if position is None else position
    fig, (top, ax) = plt.subplots(2, 1, figsize=(max(8, min(24, n * 0.15)), 7), sharex=True,
                                  gridspec_kw={"height_ratios": [1, 3]})
    score = exponents.max(-1)
    others = _others(exponents, position)
    top.bar(np.arange(n), score, color=["C0" if i == position else "C3" for i in range(n)],
            width=0.9)
    other_score = _others(score, position)
    lo, hi = min(0.0, float(other_score.min())), float(other_score.max())
    pad = 0.15 * (hi - lo or 1.0)
    top.set_ylim(lo - (pad if lo < 0 else 0), hi + pad)
    top.annotate(f"{score[position]:.3g}", (position, hi + 0.5 * pad), ha="center",
                 fontsize=7, color="C0")
    top.set_ylabel("max exponent")
    top.set_title(f"Lyapunov exponents of the prediction at position {position} w.r.t. each "
                  "input token (blue: the output token itself, off scale)")
    vmax = float(np.abs(others).max()) or 1.0
    im = ax.imshow(exponents.T, aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                   interpolation="nearest")
    ax.set_ylabel("exponent index (largest first)")
    ax.set_xlabel("input token")
    fig.colorbar(im, ax=[top, ax], label="exponent (1/unit depth)", fraction=0.03)
    _token_ticks(ax, token_text, n)
    path = pathlib.Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_trajectory(states: np.ndarray, times: np.ndarray, path) -> pathlib.Path:
    """Per-token hidden-state norm ‖x_i(t)‖ and speed ‖Δx_i‖/Δt against depth.

    ``states``: ``[P, T, d]`` for one sequence, ``times``: ``[P]``.
    """
    states, times = np.asarray(states, np.float64), np.asarray(times, np.float64)
    norms = np.linalg.norm(states, axis=-1)  # [P, T]
    speed = np.linalg.norm(np.diff(states, axis=0), axis=-1) / np.diff(times)[:, None]
    mid = 0.5 * (times[1:] + times[:-1])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    axes[0].plot(times, norms, color="C0", lw=0.5, alpha=0.4)
    axes[0].plot(times, norms.mean(-1), color="k", lw=2, label="mean over tokens")
    axes[0].set_ylabel("‖x_i(t)‖")
    axes[1].plot(mid, speed, color="C1", lw=0.5, alpha=0.4)
    axes[1].plot(mid, speed.mean(-1), color="k", lw=2, label="mean over tokens")
    axes[1].set_ylabel("‖x(t_{k+1}) − x(t_k)‖ / Δt")
    for ax in axes:
        ax.set_xlabel("depth t")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)
