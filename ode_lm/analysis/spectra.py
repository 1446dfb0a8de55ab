"""Eigen-spectra of the attention and MLP weights as functions of depth.

For every depth coordinate (a time t in [0, 1] for the ODE model, a layer index for a
discrete baseline) and every head h we take

* QK  = W_Q^h · W_K^hᵀ   (d × d, rank ≤ head_dim): the bilinear form of the attention scores,
* OV  = W_V^h · W_O^h    (d × d, rank ≤ head_dim): what a head writes back into the stream,
* MLP = W₁ · W₂          (d × d), on all hidden units or on a random subset of them.

The eigenvalues are computed on the host in float64 with numpy, batched over depth and heads,
and kept complex (magnitude, real and imaginary part are all reported; the paper's own
scripts dropped the imaginary part).

A product ``A·B`` with ``A`` of shape (n, r) and ``B`` of shape (r, n) has at most r non-zero
eigenvalues, and they are exactly the eigenvalues of the small r × r matrix ``B·A``. We
therefore decompose the smaller of the two products: for QK and OV that gives the head_dim
non-zero eigenvalues of each head; the remaining d − head_dim eigenvalues are structurally
zero and are not stored (they would only pile up at |λ| = 0 in every distribution plot).

Weights use the row-vector convention of the models (``y = x @ W``):
``w_q, w_k, w_v``: ``[P, H, d, head_dim]``, ``w_o``: ``[P, H, head_dim, d]``,
``mlp_w1``: ``[P, d, m]``, ``mlp_w2``: ``[P, m, d]`` with P the number of depth points.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from ode_lm.analysis.blas import single_threaded

WEIGHT_KEYS = ("w_q", "w_k", "w_v", "w_o", "mlp_w1", "mlp_w2")
KINDS = ("qk", "ov", "mlp")


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def product_eigenvalues(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-zero eigenvalues of ``a @ b`` (batched over leading axes), as complex128.

    ``a``: ``[..., n, r]``, ``b``: ``[..., r, n]``. Returns ``min(n, r)`` eigenvalues per
    matrix, sorted by decreasing magnitude; when r < n they come from the r × r matrix
    ``b @ a``, whose spectrum equals the non-zero part of ``a @ b``'s.
    """
    a, b = _f64(a), _f64(b)
    if a.shape[-1] != b.shape[-2] or a.shape[-2] != b.shape[-1]:
        raise ValueError(f"product_eigenvalues: shapes {a.shape} and {b.shape} do not chain")
    with single_threaded():  # see blas.py: 13x less CPU than OpenBLAS' threads here
        small = b @ a if a.shape[-1] < a.shape[-2] else a @ b
        eig = np.linalg.eigvals(small).astype(np.complex128)
    order = np.argsort(-np.abs(eig), axis=-1, kind="stable")
    return np.take_along_axis(eig, order, axis=-1)


def qk_eigenvalues(w_q: np.ndarray, w_k: np.ndarray) -> np.ndarray:
    """Eigenvalues of W_Q^h W_K^hᵀ per head: ``[P, H, d, hd]`` x2 → ``[P, H, hd]``."""
    return product_eigenvalues(w_q, np.swapaxes(_f64(w_k), -1, -2))


def ov_eigenvalues(w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """Eigenvalues of W_V^h W_O^h per head: ``[P, H, d, hd]``, ``[P, H, hd, d]`` → ``[P, H, hd]``.
    """
    return product_eigenvalues(w_v, w_o)


def mlp_eigenvalues(
    w1: np.ndarray, w2: np.ndarray, units: np.ndarray | None = None
) -> np.ndarray:
    """Eigenvalues of W₁[:, S] W₂[S, :] (S = ``units`` or all units) → ``[P, min(d, |S|)]``."""
    w1, w2 = _f64(w1), _f64(w2)
    if units is not None:
        units = np.asarray(units)
        if units.ndim != 1 or units.size == 0 or units.max() >= w1.shape[-1] or units.min() < 0:
            raise ValueError(
                f"mlp_eigenvalues: units must be a non-empty 1-D index array into the "
                f"{w1.shape[-1]} hidden units, got shape {units.shape}"
            )
        w1, w2 = w1[..., units], w2[..., units, :]
    return product_eigenvalues(w1, w2)


def random_hidden_units(hidden_dim: int, num_units: int | None, seed: int = 0) -> np.ndarray | None:
    """A sorted random subset of MLP hidden units (None = all units)."""
    if num_units is None or num_units >= hidden_dim:
        return None
    if num_units <= 0:
        raise ValueError(f"--mlp_units={num_units}: must be positive")
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(hidden_dim, size=num_units, replace=False))


@dataclasses.dataclass
class Spectra:
    """All eigenvalues of one model, indexed by depth point.

    ``depth`` holds t values (``depth_kind='t'``) or layer indices (``'layer'``).
    ``qk``/``ov``: complex ``[P, H, hd]``; ``mlp``: complex ``[P, n_mlp]``.
    """

    depth: np.ndarray
    depth_kind: str
    qk: np.ndarray
    ov: np.ndarray
    mlp: np.ndarray
    mlp_units: np.ndarray | None = None
    label: str = ""

    def kind(self, name: str) -> np.ndarray:
        """Eigenvalues of ``name`` ∈ {qk, ov, mlp} flattened per depth point: ``[P, n]``."""
        if name not in KINDS:
            raise ValueError(f"unknown spectrum kind {name!r}: expected one of {KINDS}")
        ev = getattr(self, name)
        return ev.reshape(ev.shape[0], -1)

    @property
    def normalized_depth(self) -> np.ndarray:
        """Depth mapped into [0, 1]: t itself, or (layer + 1) / L (the time a layer ends at)."""
        if self.depth_kind == "t":
            return np.asarray(self.depth, dtype=np.float64)
        return (np.asarray(self.depth, dtype=np.float64) + 1.0) / len(self.depth)

    def max_abs(self, name: str, per_head: bool = False) -> np.ndarray:
        """max |λ| per depth point (``[P]``), or per head (``[P, H]``) for qk / ov."""
        ev = getattr(self, name) if per_head else self.kind(name)
        return np.abs(ev).max(axis=-1)

    def positive_real_fraction(self, name: str = "ov", per_head: bool = False) -> np.ndarray:
        """Fraction of eigenvalues with Re λ > 0 (repulsive directions) per depth point."""
        ev = getattr(self, name) if per_head else self.kind(name)
        return (ev.real > 0).mean(axis=-1)

    def magnitude_quantiles(self, name: str, qs: Sequence[float]) -> np.ndarray:
        """Quantiles of |λ| per depth point: ``[len(qs), P]``."""
        return np.quantile(np.abs(self.kind(name)), qs, axis=-1)

    def at(self, value: float) -> int:
        """Index of the depth point nearest to ``value``."""
        return int(np.argmin(np.abs(np.asarray(self.depth, dtype=np.float64) - value)))

    def save(self, path: str | pathlib.Path) -> None:
        """Write every eigenvalue (complex) plus magnitude / real / imag views to ``.npz``."""
        out = {"depth": np.asarray(self.depth), "depth_kind": np.array(self.depth_kind),
               "label": np.array(self.label)}
        for name in KINDS:
            ev = getattr(self, name)
            out[name] = ev
            out[f"{name}_abs"] = np.abs(ev)
            out[f"{name}_real"] = ev.real
            out[f"{name}_imag"] = ev.imag
        if self.mlp_units is not None:
            out["mlp_units"] = self.mlp_units
        np.savez_compressed(path, **out)

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Spectra:
        with np.load(path) as z:
            return cls(
                depth=z["depth"], depth_kind=str(z["depth_kind"]), qk=z["qk"], ov=z["ov"],
                mlp=z["mlp"], mlp_units=z["mlp_units"] if "mlp_units" in z else None,
                label=str(z["label"]),
            )


def spectra_from_weights(
    weights: Mapping[str, np.ndarray],
    depth: np.ndarray,
    depth_kind: str = "t",
    mlp_units: np.ndarray | None = None,
    label: str = "",
) -> Spectra:
    """Eigenvalues of QK, OV and MLP from weights stacked over depth points (see module doc)."""
    missing = [k for k in WEIGHT_KEYS if k not in weights]
    if missing:
        raise ValueError(f"spectra_from_weights: missing weight arrays {missing}")
    if depth_kind not in ("t", "layer"):
        raise ValueError(f"depth_kind={depth_kind!r}: expected 't' or 'layer'")
    depth = np.asarray(depth)
    p = weights["w_q"].shape[0]
    if depth.shape != (p,):
        raise ValueError(f"depth has shape {depth.shape}, weights have {p} depth points")
    return Spectra(
        depth=depth,
        depth_kind=depth_kind,
        qk=qk_eigenvalues(weights["w_q"], weights["w_k"]),
        ov=ov_eigenvalues(weights["w_v"], weights["w_o"]),
        mlp=mlp_eigenvalues(weights["mlp_w1"], weights["mlp_w2"], mlp_units),
        mlp_units=mlp_units,
        label=label,
    )


def summary_lines(spec: Spectra, points: Sequence[float] | None = None) -> list[str]:
    """Short text summary: max |λ| of QK / OV / MLP and the OV Re>0 fraction at a few depths."""
    if points is None:
        points = (0.0, 0.5, 1.0) if spec.depth_kind == "t" else (
            float(spec.depth[0]), float(spec.depth[len(spec.depth) // 2]), float(spec.depth[-1]))
    lines = []
    name = "t" if spec.depth_kind == "t" else "layer"
    for value in points:
        i = spec.at(value)
        lines.append(
            f"{name}={float(spec.depth[i]):g}: QK max|λ|={spec.max_abs('qk')[i]:.4g}  "
            f"OV max|λ|={spec.max_abs('ov')[i]:.4g}  MLP max|λ|={spec.max_abs('mlp')[i]:.4g}  "
            f"OV Re>0 fraction={spec.positive_real_fraction('ov')[i]:.3f}"
        )
    return lines
