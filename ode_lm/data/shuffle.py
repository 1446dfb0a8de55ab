"""The seeded permutation both pipelines shuffle with (documents per epoch, files per epoch,
documents per streaming window).

Kept over ``grain.experimental.index_shuffle`` (WORKSPACE.md "Data", grain's pieces): this one
is vectorised over numpy index arrays, and checkpoints name positions in its order.
"""

from __future__ import annotations

import numpy as np


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64-style hash of uint64 values under a key (wrapping arithmetic)."""
    z = x + np.uint64((0x9E3779B97F4A7C15 * (key + 1)) & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def feistel_permute(j: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A seeded bijection of [0, n), vectorised: 4-round Feistel network + cycle walking.

    Pure integer arithmetic, so the order is identical on every machine and numpy version.
    """
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    x = np.asarray(j, np.uint64).copy()
    todo = np.ones(x.shape, bool)
    with np.errstate(over="ignore"):
        _walk_cycles(x, todo, n, half, mask, seed)
    return x.astype(np.int64)


def _walk_cycles(x: np.ndarray, todo: np.ndarray, n: int, half: int, mask: np.uint64,
                 seed: int) -> None:
    while todo.any():
        y = x[todo]
        left, right = y >> np.uint64(half), y & mask
        for r in range(4):
            left, right = right, left ^ (_mix(right, seed * 4 + r) & mask)
        y = (left << np.uint64(half)) | right
        x[todo] = y
        todo[todo] = y >= np.uint64(n)
