"""Packing documents into rows of ``seq_len + 1`` tokens, and rows into the batch format.

A *piece* is a whole document or a part of one; ``segment_ids`` number the pieces of a row
1, 2, ... (0 = padding) and ``positions`` restart at 0 at every piece, so a document cut at a
row boundary continues in the next row as a new segment whose positions start again at 0
(positions never exceed ``seq_len - 1``).

Batch rule (rows ``x`` of ``seq_len + 1`` tokens): ``inputs = x[:-1]``, ``targets = x[1:]``,
``segment_ids``/``positions`` are those of the inputs, and ``loss_mask[i] = 1`` iff the
target is not padding and either input and target belong to the same piece or the input is
EOS (the prediction of a document's first token after the previous document's EOS, as in
GPT-2 training). Predictions across any other piece boundary (the end of a cut piece followed
by an unrelated document, in first-fit) are masked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def rows_from_flat(tokens: np.ndarray, piece_ids: np.ndarray, rows: int,
                   width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts a contiguous token stream (with a piece id per token) into rows; vectorised."""
    tok = tokens.reshape(rows, width)
    pid = piece_ids.reshape(rows, width)
    start = np.ones((rows, width), bool)
    start[:, 1:] = pid[:, 1:] != pid[:, :-1]
    seg = np.cumsum(start, axis=1, dtype=np.int32)
    idx = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width))
    pos = idx - np.maximum.accumulate(np.where(start, idx, 0), axis=1)
    return tok, seg, pos.astype(np.int32)


def rows_from_pieces(row_pieces: Sequence[Sequence[np.ndarray]],
                     width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lays out each row's pieces left to right and pads (segment 0) to ``width``."""
    rows = len(row_pieces)
    tok = np.zeros((rows, width), np.int32)
    seg = np.zeros((rows, width), np.int32)
    pos = np.zeros((rows, width), np.int32)
    for r, pieces in enumerate(row_pieces):
        if not pieces:
            continue
        lens = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
        n = int(lens.sum())
        if n > width:
            raise AssertionError(f"row {r} holds {n} tokens > {width}")
        tok[r, :n] = np.concatenate(pieces)
        seg[r, :n] = np.repeat(np.arange(1, len(pieces) + 1, dtype=np.int32), lens)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        pos[r, :n] = np.arange(n) - starts
    return tok, seg, pos


def to_batch(tok: np.ndarray, seg: np.ndarray, pos: np.ndarray,
             eos_id: int) -> dict[str, np.ndarray]:
    """Rows of ``seq_len + 1`` -> the batch dict (see the module docstring for the mask rule)."""
    inputs = np.ascontiguousarray(tok[:, :-1], np.int32)
    in_seg, out_seg = seg[:, :-1], seg[:, 1:]
    mask = (out_seg != 0) & ((in_seg == out_seg) | (inputs == eos_id))
    return {
        "inputs": inputs,
        "targets": np.ascontiguousarray(tok[:, 1:], np.int32),
        "segment_ids": np.ascontiguousarray(in_seg, np.int32),
        "positions": np.ascontiguousarray(pos[:, :-1], np.int32),
        "loss_mask": mask.astype(np.float32),
    }


class FirstFit:
    """First-fit packing of pieces into ``rows`` rows of ``width``; misfits carry over."""

    def __init__(self, rows: int, width: int) -> None:
        self.rows, self.width = rows, width
        self.space = [width] * rows  # plain lists: faster than numpy for a few rows
        self.contents: list[list[np.ndarray]] = [[] for _ in range(rows)]

    def place(self, piece: np.ndarray) -> bool:
        n = len(piece)
        space = self.space
        for r in range(self.rows):
            if space[r] >= n:
                self.contents[r].append(piece)
                space[r] -= n
                return True
        return False

    @property
    def full(self) -> bool:
        return max(self.space) == 0
