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

``Packer`` is the one packer of both training pipelines: it reads a host's document sequence
block by block from a ``DocumentBlocks`` source (prepared shards: ``pipeline.PreparedBlocks``;
streaming files: ``streaming_source.StreamingBlocks``) and packs it with ``concat`` or
``first_fit``.
Its state ``{"doc", "offset", "carry"}`` (next host document, tokens already used of it,
first-fit pieces ``[doc, offset, length]`` waiting for room) is exact to the token; a source
adds its own keys (streaming: ``window``, ``reader``).

Row shuffle (``row_shuffle`` > 0 rows, ``DataConfig.row_shuffle_window``): packing cuts a long
document into consecutive rows, so in packing order a small batch holds one document for
many steps. The packer therefore packs a window of ``ceil(row_shuffle / rows)`` batches at
once, permutes its rows (``shuffle.feistel_permute``, keyed by the seed, the window's
first position and the ``salt`` of its data stream) and hands them out ``rows`` at a time.
The state is then the packing state at
the window's start plus ``"row"``, the rows of the window already handed out: a restore
re-packs the window (deterministic) and skips them, so resume stays exact and the state small.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grain
import numpy as np

from ode_lm.data.shuffle import feistel_permute

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# first-fit pieces a one-row data stream carries to its next row by default (with one bin,
# a carry of one would end every row at the first misfit: ~0.8 full instead of ~0.95)
FIRST_FIT_CARRY = 8


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


class DocumentBlocks(Protocol):
    """A host's document sequence in blocks of ``block_size`` (what ``Packer`` reads)."""

    block_size: int

    def read_block(self, b: int) -> list[np.ndarray]:
        """Documents ``[b * block_size, (b + 1) * block_size)``; short or empty at the end."""

    def release(self, low_block: int) -> None:
        """Blocks below ``low_block`` are never read again (the packer's state is past them)."""

    def get_state(self, min_doc: int) -> dict[str, Any]:
        """Extra state keys, for a packer whose oldest needed document is ``min_doc``."""

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore from a full iterator state (the packer's keys and the source's)."""

    def epoch(self, doc: int, min_doc: int) -> int:
        """The epoch of host document ``doc``."""

    def close(self) -> None:
        """Frees worker processes, readers."""


class Packer(grain.DatasetIterator):
    """Packs a ``DocumentBlocks`` source into batches (module docstring: state, batch rule)."""

    def __init__(self, source: DocumentBlocks, *, rows: int, width: int, packing: str,
                 eos_id: int, max_carry: int, start_doc: int = 0, row_shuffle: int = 0,
                 seed: int = 0, salt: int = 0) -> None:
        super().__init__()
        self._salt = salt  # tells streams' windows apart (their first positions coincide)
        # row shuffle (module docstring): batches per window, the window, its start state
        self._window_batches = -(-row_shuffle // rows) if row_shuffle > 0 else 0
        self._seed = seed
        self._window: dict[str, np.ndarray] | None = None
        self._window_start: dict[str, Any] = {}
        self._row = 0
        self._source, self._block_size = source, source.block_size
        self._rows, self._width, self._packing = rows, width, packing
        self._eos, self._max_carry = eos_id, max_carry
        self._doc, self._offset = start_doc, 0
        self._carry: list[list[int]] = []  # [doc, offset, length]
        self._blocks: dict[int, tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]] = {}

    # -- reading ---------------------------------------------------------------------------
    def _block(self, b: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """(docs, flat tokens, doc start offsets (n+1), doc index per token) of block b."""
        if b not in self._blocks:
            docs = self._source.read_block(b)
            lens = np.fromiter((len(d) for d in docs), np.int64, len(docs))
            starts = np.zeros(len(docs) + 1, np.int64)
            np.cumsum(lens, out=starts[1:])
            flat = np.concatenate(docs) if docs else np.zeros(0, np.int64)
            docid = np.repeat(np.arange(len(docs), dtype=np.int32), lens)
            self._blocks[b] = (docs, flat, starts, docid)
        return self._blocks[b]

    def _min_doc(self) -> int:
        return min([self._doc] + [c[0] for c in self._carry])

    def _release(self) -> None:
        """After a batch: drop the blocks the state no longer reaches (carry included)."""
        low = self._min_doc() // self._block_size
        for old in [x for x in self._blocks if x < low]:
            del self._blocks[old]
        self._source.release(low)

    def _get(self, k: int) -> np.ndarray | None:
        """Host document k, or None past the end of the stream."""
        b, i = divmod(k, self._block_size)
        docs = self._blocks[b][0] if b in self._blocks else self._block(b)[0]
        return docs[i] if i < len(docs) else None

    def _next_piece(self, limit: int) -> tuple[int, int, np.ndarray] | None:
        """The next at most ``limit`` unread tokens of the current document."""
        doc = self._get(self._doc)
        if doc is None:
            return None
        k, off = self._doc, self._offset
        piece = doc[off:off + limit]
        if off + len(piece) >= len(doc):
            self._doc, self._offset = self._doc + 1, 0
        else:
            self._offset += len(piece)
        return k, off, piece

    # -- packing ---------------------------------------------------------------------------
    def _concat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised per block: slices of the flat token stream, no per-document Python."""
        need = self._rows * self._width
        parts, pids = [], []
        while need > 0:
            b, i = divmod(self._doc, self._block_size)
            docs, flat, starts, docid = self._block(b)
            if i >= len(docs):
                raise StopIteration
            pos = int(starts[i]) + self._offset
            take = min(int(starts[-1]) - pos, need)
            parts.append(flat[pos:pos + take])
            pids.append(docid[pos:pos + take] + np.int32(b * self._block_size % (1 << 30)))
            end = pos + take
            j = int(np.searchsorted(starts, end, side="right")) - 1
            if j >= len(docs):
                self._doc, self._offset = (b + 1) * self._block_size, 0
            else:
                self._doc, self._offset = b * self._block_size + j, end - int(starts[j])
            need -= take
        flat_out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        pid = np.concatenate(pids) if len(pids) > 1 else pids[0]
        return rows_from_flat(flat_out, pid, self._rows, self._width)

    def _first_fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ff = FirstFit(self._rows, self._width)
        carry: list[list[int]] = []
        for k, off, n in self._carry:
            piece = self._get(k)[off:off + n]  # type: ignore[index]
            if not ff.place(piece):
                carry.append([k, off, n])
        placed_any = len(carry) < len(self._carry)
        while len(carry) < self._max_carry and not ff.full:
            nxt = self._next_piece(self._width)
            if nxt is None:
                break
            k, off, piece = nxt
            if ff.place(piece):
                placed_any = True
            else:
                carry.append([k, off, len(piece)])
        if not placed_any:
            raise StopIteration
        self._carry = carry
        return rows_from_pieces(ff.contents, self._width)

    def __next__(self) -> dict[str, np.ndarray]:
        with self._stats.record_self_time():
            if not self._window_batches:
                return self._pack_batch()
            if self._window is None or self._row >= len(self._window["inputs"]):
                self._fill_window()
            assert self._window is not None
            row, self._row = self._row, self._row + self._rows
            return {k: v[row:row + self._rows] for k, v in self._window.items()}

    def _fill_window(self) -> None:
        """Packs the next window of batches and permutes its rows (module docstring)."""
        self._window, self._row = None, 0
        self._window_start = start = self._pack_state()
        batches = []
        for _ in range(self._window_batches):
            try:
                batches.append(self._pack_batch())
            except StopIteration:  # a finite stream's last, shorter window
                break
        if not batches:
            raise StopIteration
        n = len(batches) * self._rows
        key = ((self._seed << 32) ^ (start["doc"] << 12) ^ start["offset"]) \
            + self._salt * 0x632BE59BD9B4E019
        perm = feistel_permute(np.arange(n), n, key)
        self._window = {k: np.concatenate([b[k] for b in batches])[perm] for k in batches[0]}

    def _pack_batch(self) -> dict[str, np.ndarray]:
        """The next batch in packing order."""
        if self._packing == "concat":
            state = self._pack_state()
            try:
                tok, seg, pos = self._concat()
            except StopIteration:
                self._restore_pack_state(state)
                raise
        else:
            tok, seg, pos = self._first_fit()
        self._release()
        return to_batch(tok, seg, pos, self._eos)

    def _pack_state(self) -> dict[str, Any]:
        state = {"doc": self._doc, "offset": self._offset,
                 "carry": [list(c) for c in self._carry]}
        state.update(self._source.get_state(self._min_doc()))
        return state

    def get_state(self) -> dict[str, Any]:
        if not self._window_batches:
            return self._pack_state()
        if self._window is None or self._row >= len(self._window["inputs"]):
            return {**self._pack_state(), "row": 0}  # the next window starts here
        return {**self._window_start, "row": self._row}

    def set_state(self, state: dict[str, Any]) -> None:
        self._restore_pack_state(state)
        self._window, self._row = None, 0
        if self._window_batches and state.get("row", 0):
            self._fill_window()  # the same window again, then past its rows handed out
            self._row = int(state["row"])

    def _restore_pack_state(self, state: dict[str, Any]) -> None:
        self._blocks = {}
        self._doc, self._offset = int(state["doc"]), int(state["offset"])
        self._carry = [[int(x) for x in c] for c in state.get("carry", [])]
        self._source.set_state(state)

    @property
    def epoch(self) -> int:
        """The epoch of the next document this host reads."""
        return self._source.epoch(self._doc, self._min_doc())

    def close(self) -> None:
        self._source.close()
        super().close()


class PackedDataset(grain.IterDataset):
    """A ``Packer`` over a fresh source per iterator (a source holds readers, positions)."""

    def __init__(self, make_source: Callable[[], DocumentBlocks], **packer_kwargs: Any) -> None:
        super().__init__()
        self._make_source, self._kwargs = make_source, packer_kwargs

    def __iter__(self) -> Packer:
        return Packer(self._make_source(), **self._kwargs)

    def __str__(self) -> str:
        return f"PackedDataset({self._kwargs['packing']})"
