"""Tolerances derived from the dtype and the computation, not from the machine a test was
written on.

float32 rounds to 24 significant bits: one unit in the last place (ulp) at 1.0 is
``F32_EPS`` = 2**-23 ≈ 1.19e-7, and every rounding is at most half an ulp of its result. A sum
of n products, whatever order XLA or BLAS picks, is within ``n · eps · Σ|a_i b_i|`` of the
exact value (the classic γ_n bound), so two float32 programs that only reassociate the same
sums agree to a few ulps *of the magnitude of the terms*, not of the (possibly cancelled)
result. Comparisons of two float32 computations therefore use an absolute tolerance scaled by
the magnitude of the compared quantity (``f32_atol``), never a bare 1e-8.
"""

from __future__ import annotations

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23


def f32_atol(reference, ulps: float) -> float:
    """``ulps`` float32 ulps at the largest magnitude in ``reference``."""
    return float(ulps * F32_EPS * np.max(np.abs(np.asarray(reference))))


def dot_bound(abs_result, n: int) -> np.ndarray:
    """The γ_n rounding bound of a float32 sum of ``n`` products; ``abs_result`` is the same
    computation on the absolute values of the inputs (Σ|a_i b_i| per output)."""
    return n * F32_EPS * np.asarray(abs_result)
