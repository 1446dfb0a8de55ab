"""Run numpy's LAPACK single-threaded inside a block.

Measured on a small CPU shared with other processes: ``np.linalg.eigvals`` on 16 matrices of
256 × 256 took 10.5 s of CPU with OpenBLAS' default threads and 0.8 s with one thread. The
Hessenberg/QR iterations of a general eigensolver work on small panels, so extra OpenBLAS
threads mostly spin. Batched eigenvalue and QR calls therefore run under
``single_threaded()``. Without threadpoolctl we call the setter that numpy's bundled OpenBLAS
exports; when no such library is found the block is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator

import numpy as np

_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
            "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
            "openblas_get_num_threads")


def _load():
    libs_dir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs_dir, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        setter = next((getattr(lib, s) for s in _SETTERS if hasattr(lib, s)), None)
        getter = next((getattr(lib, g) for g in _GETTERS if hasattr(lib, g)), None)
        if setter is not None and getter is not None:
            setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
            return setter, getter
    return None


_API = _load()


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """One OpenBLAS thread for numpy inside the block (restored afterwards)."""
    if _API is None:
        yield
        return
    setter, getter = _API
    before = getter()
    setter(1)
    try:
        yield
    finally:
        setter(before)
