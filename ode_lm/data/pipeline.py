"""The training pipeline: shards -> epoch-aware shuffle -> host slice -> pack -> batch -> prefetch.

``make_prepared_iterator`` (via ``data.make_train_iterator``) returns a checkpointable grain
``DatasetIterator`` of host-local batches (see ``ode_lm.data.packing`` for the batch format
and mask rule);
``to_global_batch`` turns one into global ``jax.Array``s sharded over ``activation_batch``.

Order: host ``p`` of ``P`` reads the global document sequence ``g = p, p + P, p + 2P, ...``
where global position ``g`` is document ``shuffle_e(g mod N)`` of epoch ``e = g // N`` (a
fresh seeded permutation per epoch, ``feistel_permute``). Hosts therefore
split every epoch into disjoint parts that together cover it exactly. The iterator state is
``{"doc", "offset", "carry"}`` (position in the host's document sequence, tokens already used
of the current document, first-fit pieces waiting for room): small JSON, exact to the token.
Threads and prefetch depth never change the batches.

Fallback when the state is lost (e.g. a new topology): ``make_train_iterator(..., start_step=s)``
starts at host document ``floor(s * rows * (seq_len + 1) / mean_doc_tokens)`` - where a host
is after ``s`` steps on average - with no carry. It is deterministic, lands in the right
epoch, and never silently restarts the epoch; it may skip or repeat a fraction of a batch.
"""

from __future__ import annotations

import sys
from typing import Any

import grain
import numpy as np

from ode_lm.data import packing as packing_lib
from ode_lm.data import prepare as prep
from ode_lm.data.config import DataConfig

_BLOCK = 1024  # documents read per ArrayRecord call


class ShardRecords:
    """Random access to the documents (token arrays) of a split's ArrayRecord shards."""

    def __init__(self, paths: list[str], counts: list[int], dtype: str, threads: int = 2) -> None:
        self.paths, self.dtype, self.threads = paths, np.dtype(dtype), max(1, threads)
        self.ends = np.cumsum(counts)
        self._readers: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _reader(self, shard: int):
        if shard not in self._readers:
            from array_record.python.array_record_module import ArrayRecordReader

            try:
                self._readers[shard] = ArrayRecordReader(
                    self.paths[shard], f"readahead_buffer_size:0,max_parallelism:{self.threads}")
            except Exception as e:  # noqa: BLE001 - riegeli raises plain RuntimeError/ValueError
                raise prep.PreparedDataError(f"shard {self.paths[shard]} is unreadable "
                                             f"(truncated or corrupt?): {e}") from None
        return self._readers[shard]

    def __getitems__(self, indices: np.ndarray | list[int]) -> list[np.ndarray]:
        idx = np.asarray(indices, np.int64)
        shards = np.searchsorted(self.ends, idx, side="right")
        out: list[np.ndarray | None] = [None] * len(idx)
        for s in np.unique(shards):
            where = np.nonzero(shards == s)[0]
            local = idx[where] - (self.ends[s - 1] if s else 0)
            order = np.argsort(local, kind="stable")  # ascending offsets read faster
            where, local = where[order], local[order]
            try:
                recs = self._reader(int(s)).read(local.tolist())
            except Exception as e:  # noqa: BLE001
                raise prep.PreparedDataError(f"shard {self.paths[s]}: cannot read records "
                                             f"(truncated or corrupt?): {e}") from None
            for w, r in zip(where, recs, strict=True):
                out[w] = np.frombuffer(r, self.dtype)
        return out  # type: ignore[return-value]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.__getitems__([index])[0]


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


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


class HostOrder:
    """Host ``p``'s k-th document -> record index (epoch-aware shuffle, then host slice)."""

    def __init__(self, num_docs: int, seed: int, process_index: int, process_count: int,
                 num_epochs: int | None) -> None:
        self.n, self.seed, self.p, self.pc = num_docs, seed, process_index, process_count
        total = num_docs * num_epochs if num_epochs is not None else None
        self.length = sys.maxsize if total is None else max(0, -(-(total - process_index)
                                                                // process_count))

    def __len__(self) -> int:
        return self.length

    def epoch(self, k: int) -> int:
        return (self.p + self.pc * k) // self.n

    def lookup(self, ks: np.ndarray) -> np.ndarray:
        """Record indices of host documents ``ks`` (all < len(self))."""
        g = self.p + self.pc * np.asarray(ks, np.int64)
        epochs, j = np.divmod(g, self.n)
        out = np.empty_like(j)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = feistel_permute(j[sel], self.n, (self.seed << 20) + int(e))
        return out

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < self.length:
            raise IndexError(k)
        return int(self.lookup(np.array([k]))[0])


class PackedBatchIterator(grain.DatasetIterator):
    """Packs the host's document sequence into batches; state is exact to the token."""

    def __init__(self, records: ShardRecords, order: HostOrder, *, rows: int, width: int,
                 packing: str, eos_id: int, max_carry: int, start_doc: int = 0) -> None:
        super().__init__()
        self._records, self._order = records, order
        self._rows, self._width, self._packing = rows, width, packing
        self._eos, self._max_carry = eos_id, max_carry
        self._doc, self._offset = start_doc, 0
        self._carry: list[list[int]] = []  # [doc, offset, length]
        self._block_size = _BLOCK
        self._blocks: dict[int, tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]] = {}

    # -- reading ---------------------------------------------------------------------------
    def _read_block(self, b: int) -> list[np.ndarray]:
        """Documents [b * block_size, (b + 1) * block_size) of the host sequence (short at end)."""
        start = b * self._block_size
        stop = min(start + self._block_size, len(self._order))
        if start >= stop:
            return []
        return self._records.__getitems__(self._order.lookup(np.arange(start, stop)))

    def _block(self, b: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """(docs, flat tokens, doc start offsets (n+1), doc index per token) of block b."""
        if b not in self._blocks:
            low = self._min_doc() // self._block_size
            for old in [x for x in self._blocks if x < low]:
                del self._blocks[old]
            docs = self._read_block(b)
            lens = np.fromiter((len(d) for d in docs), np.int64, len(docs))
            starts = np.zeros(len(docs) + 1, np.int64)
            np.cumsum(lens, out=starts[1:])
            flat = np.concatenate(docs) if docs else np.zeros(0, np.int64)
            docid = np.repeat(np.arange(len(docs), dtype=np.int32), lens)
            self._blocks[b] = (docs, flat, starts, docid)
        return self._blocks[b]

    def _min_doc(self) -> int:
        return min([self._doc] + [c[0] for c in self._carry])

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
        return packing_lib.rows_from_flat(flat_out, pid, self._rows, self._width)

    def _first_fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ff = packing_lib.FirstFit(self._rows, self._width)
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
        return packing_lib.rows_from_pieces(ff.contents, self._width)

    def __next__(self) -> dict[str, np.ndarray]:
        with self._stats.record_self_time():
            if self._packing == "concat":
                state = self.get_state()
                try:
                    tok, seg, pos = self._concat()
                except StopIteration:
                    self.set_state(state)
                    raise
            else:
                tok, seg, pos = self._first_fit()
            return packing_lib.to_batch(tok, seg, pos, self._eos)

    def get_state(self) -> dict[str, Any]:
        return {"doc": self._doc, "offset": self._offset, "carry": [list(c) for c in self._carry]}

    def set_state(self, state: dict[str, Any]) -> None:
        self._blocks = {}
        self._doc, self._offset = int(state["doc"]), int(state["offset"])
        self._carry = [[int(x) for x in c] for c in state.get("carry", [])]

    @property
    def epoch(self) -> int:
        """The epoch of the next document this host reads."""
        return self._order.epoch(self._doc)


class PackedBatchDataset(grain.IterDataset):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._kwargs = kwargs

    def __iter__(self) -> PackedBatchIterator:
        return PackedBatchIterator(**self._kwargs)

    def __str__(self) -> str:
        return f"PackedBatchDataset({self._kwargs['packing']})"


def resolve_processes(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    return process_index, process_count


def host_rows(global_batch: int, process_count: int, what: str = "global_batch_size") -> int:
    if global_batch % process_count:
        raise ValueError(f"DataConfig.{what}={global_batch} is not divisible by "
                         f"process_count={process_count}")
    return global_batch // process_count


def open_split(cfg: DataConfig, split: str) -> tuple[dict[str, Any], ShardRecords]:
    """The split's records after the open-time checks (``ode_lm.data.manifest``): manifest,
    tokenizer, preparation settings, and the split's shards (exist, bytes, record counts)."""
    manifest = prep.load_manifest(cfg.data_dir)
    prep.check_tokenizer(manifest, cfg.tokenizer)
    prep.check_settings(manifest, cfg)
    paths = prep.shard_paths(manifest, split)
    info = manifest["splits"][split]
    if info["documents"] == 0:
        raise prep.PreparedDataError(f"{cfg.data_dir}: split {split!r} has no documents "
                                     f"(holdout_fraction={manifest['holdout']['fraction']})")
    counts = [s["documents"] for s in info["shards"]]
    return manifest, ShardRecords(paths, counts, manifest["dtype"], cfg.num_threads)


def make_prepared_iterator(cfg: DataConfig, *, process_index: int, process_count: int,
                           start_step: int = 0, split: str = "train") -> grain.DatasetIterator:
    """Host-local training batches of ``global_batch_size // process_count`` rows from the
    prepared shards (``data.make_train_iterator`` picks this or streaming)."""
    p, pc = process_index, process_count
    rows = host_rows(cfg.global_batch_size, pc)
    manifest, records = open_split(cfg, split)
    info = manifest["splits"][split]
    width = cfg.seq_len + 1
    if info["tokens"] < cfg.global_batch_size * width:
        raise ValueError(f"{cfg.data_dir}: split {split!r} has {info['tokens']} tokens, fewer than "
                         f"one batch ({cfg.global_batch_size} x {width} = "
                         f"{cfg.global_batch_size * width}); use more data or a smaller batch")
    order = HostOrder(len(records), cfg.seed, p, pc, cfg.num_epochs)
    start_doc = 0
    if start_step:
        mean_doc = info["tokens"] / info["documents"]
        start_doc = int(start_step * rows * width // mean_doc)
    ds: grain.IterDataset = PackedBatchDataset(
        records=records, order=order, rows=rows, width=width, packing=cfg.packing,
        eos_id=manifest["eos_id"], max_carry=cfg.first_fit_bins or rows, start_doc=start_doc)
    if cfg.prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
    return iter(ds)


def to_global_batch(batch: dict[str, np.ndarray], mesh, rules) -> dict[str, Any]:
    """Host-local numpy batch -> global ``jax.Array``s (``make_array_from_process_local_data``),
    sharded over ``activation_batch`` as the run's logical-axis ``rules`` map it (required,
    so gin overrides always reach the data; ``partitioning.LOGICAL_AXIS_RULES`` for none)."""
    import jax

    from ode_lm import partitioning

    sharding = partitioning.batch_sharding(mesh, rules)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in batch.items()}
