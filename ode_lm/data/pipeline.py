"""The prepared training pipeline: shards -> epoch-aware shuffle -> data streams -> pack ->
row shuffle -> the host's rows of the global batch -> prefetch.

``make_prepared_iterator`` (via ``data.make_train_iterator``) returns a checkpointable grain
``DatasetIterator`` of host-local batches: a ``streams.HostStreams`` over one
``packing.Packer`` per data stream (one row a step) reading ``PreparedBlocks`` (the stream's
documents, read from the shards in blocks); ``to_global_batch`` turns one into global
``jax.Array``s sharded over ``activation_batch``.

Order: global position ``g`` is document ``shuffle_e(g mod N)`` of epoch ``e = g // N`` (a
fresh seeded permutation per epoch, ``shuffle.feistel_permute``). Data stream ``v`` of
``V = global_batch_size`` reads positions ``g = v, v + V, v + 2V, ...`` (``StreamOrder``) and
packs global row ``v`` of every batch, so streams split every epoch into disjoint parts
that together cover it exactly, and the global batch at step ``s`` is the same on any
number of hosts; host ``p`` of ``P`` runs streams ``[p*B/P, (p+1)*B/P)`` (``host_streams.py``).
A stream's packer state is ``{"doc", "offset", "carry"}`` (position in the stream's document
sequence, tokens already used of the current document, first-fit pieces waiting for room),
plus ``"row"`` with the row shuffle on (``packing.Packer``; a stream's window is
``streams.window_rows`` rows): small JSON, exact to the token. The iterator's state holds
every stream of the host, keyed by stream id; a restore on another host count reads all
hosts' files (``streams.global_state``). Threads and prefetch depth never change the batches.

Fallback when the state is lost: ``make_train_iterator(..., start_step=s)`` starts every
stream at its document ``floor(s * (seq_len + 1) / mean_doc_tokens)`` - where a stream is
after ``s`` steps on average - with no carry. It is deterministic, lands in the right
epoch, and never silently restarts the epoch; it may skip or repeat a fraction of a batch.
"""

from __future__ import annotations

import sys
from typing import Any

import grain
import numpy as np

from ode_lm.data import host_streams as streams_lib
from ode_lm.data import packing as packing_lib
from ode_lm.data import prepare as prep
from ode_lm.data.config import DataConfig
from ode_lm.data.shuffle import feistel_permute

_BLOCK = 1024  # documents read per ArrayRecord call


class ShardRecords:
    """Random access to the documents (token arrays) of a split's ArrayRecord shards (kept over
    ``grain.sources.ArrayRecordDataSource``: one sorted read per shard, no thread pool per call;
    WORKSPACE.md "Data" has the figures)."""

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


class StreamOrder:
    """Stream ``v``'s k-th document -> record index (epoch-aware shuffle, then positions
    ``v, v + V, ...`` of the global order)."""

    def __init__(self, num_docs: int, seed: int, stream: int, num_streams: int,
                 num_epochs: int | None) -> None:
        self.n, self.seed, self.p, self.pc = num_docs, seed, stream, num_streams
        total = num_docs * num_epochs if num_epochs is not None else None
        self.length = sys.maxsize if total is None else max(0, -(-(total - stream)
                                                                // num_streams))

    def __len__(self) -> int:
        return self.length

    def epoch(self, k: int) -> int:
        return (self.p + self.pc * k) // self.n

    def lookup(self, ks: np.ndarray) -> np.ndarray:
        """Record indices of stream documents ``ks`` (all < len(self))."""
        return self.at(self.p + self.pc * np.asarray(ks, np.int64))

    def at(self, g: np.ndarray) -> np.ndarray:
        """Record indices of global positions ``g`` (any streams: one permutation call)."""
        epochs, j = np.divmod(np.asarray(g, np.int64), self.n)
        out = np.empty_like(j)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = feistel_permute(j[sel], self.n, (self.seed << 20) + int(e))
        return out

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < self.length:
            raise IndexError(k)
        return int(self.lookup(np.array([k]))[0])


class HostReader:
    """Reads block ``b`` of every local stream about to need it in one call (one sorted read
    per shard, one permutation), as the streams advance in step; a block is handed out once
    (the packer keeps it), a re-read after a restore reads that stream's alone."""

    def __init__(self, records: ShardRecords, orders: dict[int, StreamOrder],
                 block_size: int) -> None:
        self._records, self._orders, self.block_size = records, orders, block_size
        self._next = dict.fromkeys(orders, 0)  # the block each stream reads next in order
        self._ready: dict[tuple[int, int], list[np.ndarray]] = {}

    def _range(self, v: int, b: int) -> np.ndarray:
        start = b * self.block_size
        return np.arange(start, min(start + self.block_size, len(self._orders[v])))

    def read(self, v: int, b: int) -> list[np.ndarray]:
        if (v, b) not in self._ready:
            group = [u for u, nb in self._next.items() if nb == b] if self._next[v] == b else [v]
            ks = [self._range(u, b) for u in group]
            order = self._orders[v]
            g = np.concatenate([u + order.pc * k for u, k in zip(group, ks, strict=True)])
            docs = self._records.__getitems__(order.at(g)) if len(g) else []
            at = 0
            for u, k in zip(group, ks, strict=True):
                self._ready[(u, b)], at = docs[at:at + len(k)], at + len(k)
                self._next[u] = b + 1
        return self._ready.pop((v, b))

    def reset(self, v: int) -> None:
        """Stream ``v`` was restored: it reads from wherever it asks next."""
        for key in [k for k in self._ready if k[0] == v]:
            del self._ready[key]
        self._next[v] = -1


class PreparedBlocks:
    """The prepared pipeline's ``packing.DocumentBlocks``: a stream's documents, in
    ``StreamOrder``, read through the host's ``HostReader`` (nothing to add to the state;
    the block size never changes the batches)."""

    def __init__(self, reader: HostReader, stream: int, order: StreamOrder) -> None:
        self._reader, self._v, self._order = reader, stream, order
        self.block_size = reader.block_size

    def read_block(self, b: int) -> list[np.ndarray]:
        if b * self.block_size >= len(self._order):
            return []
        return self._reader.read(self._v, b)

    def release(self, low_block: int) -> None:
        pass

    def get_state(self, min_doc: int) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        self._reader.reset(self._v)

    def epoch(self, doc: int, min_doc: int) -> int:
        return self._order.epoch(doc)

    def close(self) -> None:
        pass


def resolve_processes(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    return process_index, process_count


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


def check_batch_fits(cfg: DataConfig, info: dict[str, Any], split: str, where: str) -> None:
    width = cfg.seq_len + 1
    if info["tokens"] < cfg.global_batch_size * width:
        raise ValueError(f"{where}: split {split!r} has {info['tokens']} tokens, fewer than "
                         f"one batch ({cfg.global_batch_size} x {width} = "
                         f"{cfg.global_batch_size * width}); use more data or a smaller batch")


def stream_packers(cfg: DataConfig, records: ShardRecords, manifest: dict[str, Any], *,
                   split: str, streams: range, seed: int, salt: int = 0,
                   start_step: int = 0) -> streams_lib.MakePacker:
    """stream ``v`` -> its ``Packer`` (one row a step) over one prepared data dir; ``seed``
    orders its documents, ``salt`` keys its row-shuffle windows apart from other sources'."""
    info = manifest["splits"][split]
    width, num_streams = cfg.seq_len + 1, cfg.global_batch_size
    start_doc = int(start_step * width // (info["tokens"] / info["documents"])) if start_step else 0
    block = max(16, _BLOCK // max(1, len(streams)))  # ~_BLOCK documents a host reads at once
    window = streams_lib.window_rows(cfg.row_shuffle_window, num_streams)
    orders = {v: StreamOrder(len(records), seed, v, num_streams, cfg.num_epochs) for v in streams}
    reader = HostReader(records, orders, block)

    def make(component: int, v: int) -> packing_lib.Packer:
        return packing_lib.Packer(
            PreparedBlocks(reader, v, orders[v]), rows=1, width=width, packing=cfg.packing,
            eos_id=manifest["eos_id"], max_carry=cfg.first_fit_bins or packing_lib.FIRST_FIT_CARRY,
            row_shuffle=window, seed=cfg.seed, salt=salt * num_streams + v, start_doc=start_doc)
    return make


def make_prepared_iterator(cfg: DataConfig, *, process_index: int, process_count: int,
                           start_step: int = 0, split: str = "train") -> grain.DatasetIterator:
    """Host-local training batches (this host's ``global_batch_size // process_count`` rows of
    the global batch) from the prepared shards (``data.make_train_iterator`` picks this or
    streaming)."""
    streams = streams_lib.host_streams(cfg.global_batch_size, process_index, process_count)
    manifest, records = open_split(cfg, split)
    check_batch_fits(cfg, manifest["splits"][split], split, cfg.data_dir)
    make = stream_packers(cfg, records, manifest, split=split, streams=streams, seed=cfg.seed,
                          start_step=start_step)
    ds: grain.IterDataset = streams_lib.StreamsDataset(
        make_packer=make, names=[""], streams=streams, num_streams=cfg.global_batch_size,
        start_step=start_step)
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
