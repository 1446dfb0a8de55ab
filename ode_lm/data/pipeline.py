"""The training pipeline: shards -> epoch-aware shuffle -> host slice -> pack -> row shuffle ->
batch -> prefetch.

``make_prepared_iterator`` (via ``data.make_train_iterator``) returns a checkpointable grain
``DatasetIterator`` of host-local batches: ``packing.Packer`` (batch format, mask rule, state)
over ``PreparedBlocks`` (this host's documents, read from the shards in blocks);
``to_global_batch`` turns one into global ``jax.Array``s sharded over ``activation_batch``.

Order: host ``p`` of ``P`` reads the global document sequence ``g = p, p + P, p + 2P, ...``
where global position ``g`` is document ``shuffle_e(g mod N)`` of epoch ``e = g // N`` (a
fresh seeded permutation per epoch, ``shuffle.feistel_permute``). Hosts therefore
split every epoch into disjoint parts that together cover it exactly. The iterator state is
``{"doc", "offset", "carry"}`` (position in the host's document sequence, tokens already used
of the current document, first-fit pieces waiting for room), plus ``"row"`` with the row
shuffle on (``packing.Packer``: the packing state at the window's start and the rows of it
handed out): small JSON, exact to the token.
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


class PreparedBlocks:
    """The prepared pipeline's ``packing.DocumentBlocks``: the host's documents, in
    ``HostOrder``, read from the shards ``_BLOCK`` at a time (nothing to add to the state)."""

    block_size = _BLOCK

    def __init__(self, records: ShardRecords, order: HostOrder) -> None:
        self._records, self._order = records, order

    def read_block(self, b: int) -> list[np.ndarray]:
        start = b * self.block_size
        stop = min(start + self.block_size, len(self._order))
        if start >= stop:
            return []
        return self._records.__getitems__(self._order.lookup(np.arange(start, stop)))

    def release(self, low_block: int) -> None:
        pass

    def get_state(self, min_doc: int) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        pass

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
    ds: grain.IterDataset = packing_lib.PackedDataset(
        lambda: PreparedBlocks(records, order), rows=rows, width=width, packing=cfg.packing,
        eos_id=manifest["eos_id"], max_carry=cfg.first_fit_bins or rows,
        row_shuffle=cfg.row_shuffle_window, seed=cfg.seed, start_doc=start_doc)
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
