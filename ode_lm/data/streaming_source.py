"""Streaming mode: batches straight from unprepared files (e.g. OpenWebText parquet on gs://).

Chain: per-epoch seeded file shuffle -> host's files (positions p, p+P, ... of each epoch's
permutation) -> interleave ``interleave_files`` open files round-robin, one document at a time
-> window of ``shuffle_window`` documents, tokenized together (threads inside the tokenizer,
or ``num_workers`` processes; the order never depends on either) -> seeded permutation of the
window (``StreamingBlocks``: one window = one block) -> ``packing.Packer``, the prepared
pipeline's packer and batch format.

State (JSON): the packer's ``doc``/``offset``/``carry`` plus, for the oldest window still
needed, the reader position at its start (next file, open files and documents consumed in
each, round-robin turn). Restoring re-opens those files, skips the consumed documents
(parquet skips whole row groups) and re-tokenizes that window: exact, and cheap.

No holdout is applied in streaming mode; evaluate on a prepared validation split.
Empty or unreadable files are skipped with a warning (once per file); a source whose files are
all skipped stops with one line naming it.

Fallback without state (``start_step=s``): the reader starts at host file
``floor(s * rows * (seq_len + 1) / tokens_in_first_nonempty_host_file)`` with fresh slots -
deterministic, in the right epoch, never a silent restart.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from ode_lm.data import packing as packing_lib
from ode_lm.data import sources as sources_lib
from ode_lm.data import tokenizers as tok_lib
from ode_lm.data.config import DataConfig
from ode_lm.data.host_streams import host_rows
from ode_lm.data.shuffle import feistel_permute

_WORKER_TOK: dict[tuple[str, str], tok_lib.Tokenizer] = {}


def _encode_in_worker(spec: str, data_dir: str, texts: list[str]) -> list[np.ndarray]:
    if (spec, data_dir) not in _WORKER_TOK:
        _WORKER_TOK[(spec, data_dir)] = tok_lib.get_tokenizer(spec, data_dir)
    return _WORKER_TOK[(spec, data_dir)].encode_batch(texts)


class HostFiles:
    """Host file sequence index f -> file path (epoch-aware shuffle of the file list)."""

    def __init__(self, files: list[str], seed: int, p: int, pc: int,
                 num_epochs: int | None) -> None:
        if len(files) < pc:
            raise ValueError(f"streaming: {len(files)} source files for {pc} processes; every "
                             "host needs at least one file (split the files, or prepare the data)")
        self.files, self.seed, self.p, self.pc = files, seed, p, pc
        self.per_epoch = -(-(len(files) - p) // pc)
        self.length = None if num_epochs is None else self.per_epoch * num_epochs

    def __getitem__(self, f: int) -> str | None:
        if self.length is not None and f >= self.length:
            return None
        e, j = divmod(f, self.per_epoch)
        pos = self.p + self.pc * j
        idx = feistel_permute(np.array([pos]), len(self.files), (self.seed << 20) + 7919 + e)
        return self.files[int(idx[0])]


class DocReader:
    """Round-robin over ``slots`` open files; its state is a small JSON dict. A finished file's
    slot goes to the next file at the same turn (``grain.experimental.InterleaveIterDataset``
    orders differently and is slower here: WORKSPACE.md "Data")."""

    def __init__(self, files: HostFiles, cfg: DataConfig, state: dict[str, Any],
                 skipped: sources_lib.SkippedFiles | None = None) -> None:
        self.files, self.cfg = files, cfg
        self.skipped = skipped if skipped is not None else sources_lib.SkippedFiles()
        self.next_file = int(state["next_file"])
        self.turn = int(state["turn"])
        self.slots: list[list[int]] = [[int(f), int(c)] for f, c in state["slots"]]
        self._iters: list[Iterator[sources_lib.Document] | None] = [None] * len(self.slots)

    @staticmethod
    def initial(start_file: int = 0) -> dict[str, Any]:
        return {"next_file": start_file, "turn": 0, "slots": []}

    def state(self) -> dict[str, Any]:
        return {"next_file": self.next_file, "turn": self.turn,
                "slots": [list(s) for s in self.slots]}

    def _open(self, slot: int) -> Iterator[sources_lib.Document]:
        f, consumed = self.slots[slot]
        path = self.files[f]
        return sources_lib.iter_source_file(  # empty / unreadable files: warned, skipped
            path, self.skipped, text_field=self.cfg.text_field,
            text_delimiter=self.cfg.text_delimiter, skip=consumed)

    def _check_progress(self) -> None:
        """Every file of the source skipped (empty or unreadable): no document will ever come."""
        if len(self.skipped.reasons) >= len(self.files.files) and \
                set(self.skipped.reasons) >= set(self.files.files):
            raise sources_lib.SourceError(f"streaming: source {self.cfg.source!r}: no documents "
                                          f"({self.skipped.describe()})")

    def _fill(self) -> None:
        while len(self.slots) < self.cfg.interleave_files and self.files[self.next_file]:
            self.slots.append([self.next_file, 0])
            self._iters.append(None)
            self.next_file += 1

    def next(self) -> sources_lib.Document | None:
        self._fill()
        while self.slots:
            self.turn %= len(self.slots)
            s = self.turn
            if self._iters[s] is None:
                self._iters[s] = self._open(s)
            doc = next(self._iters[s], None)  # type: ignore[arg-type]
            if doc is None:  # file done: the next file takes its slot, same turn
                self._check_progress()
                path = self.files[self.next_file]
                if path is None:
                    del self.slots[s], self._iters[s]
                else:
                    self.slots[s], self._iters[s] = [self.next_file, 0], None
                    self.next_file += 1
                continue
            self.slots[s][1] += 1
            self.turn = s + 1
            return doc
        return None


class StreamingBlocks:
    """Streaming's ``packing.DocumentBlocks``: block ``w`` is shuffle window ``w`` (documents
    read round-robin, tokenized together, then permuted). The state adds the reader position
    at the start of the oldest window the packer still needs (``window``, ``reader``)."""

    def __init__(self, cfg: DataConfig, files: HostFiles, *, eos_id: int,
                 start_file: int = 0) -> None:
        self._cfg, self._files, self._eos = cfg, files, eos_id
        self.block_size = max(1, cfg.shuffle_window)
        self._tok = tok_lib.get_tokenizer(cfg.tokenizer, cfg.data_dir, num_threads=cfg.num_threads)
        self._pool: cf.ProcessPoolExecutor | None = None
        self._window_state: dict[int, dict[str, Any]] = {0: DocReader.initial(start_file)}
        self._reader: DocReader | None = None
        self._reader_window = -1  # the window the reader is positioned at the start of
        self._skipped = sources_lib.SkippedFiles()  # empty/unreadable files, warned about once

    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        if self._cfg.num_workers <= 0 or len(texts) < 2:
            return self._tok.encode_batch(texts)
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                self._cfg.num_workers, mp_context=multiprocessing.get_context("spawn"))
        n = -(-len(texts) // self._cfg.num_workers)
        parts = [texts[i:i + n] for i in range(0, len(texts), n)]
        out: list[np.ndarray] = []
        spec, d = self._cfg.tokenizer, self._cfg.data_dir
        for ids in self._pool.map(_encode_in_worker, [spec] * len(parts), [d] * len(parts), parts):
            out.extend(ids)
        return out

    def read_block(self, w: int) -> list[np.ndarray]:
        if self._reader is None or self._reader_window != w:
            start = self._window_state.get(w)
            if start is None:  # windows are read in order: load the previous one first
                self.read_block(w - 1)
                start = self._window_state[w]
            self._reader = DocReader(self._files, self._cfg, start, self._skipped)
        texts = []
        while len(texts) < self.block_size:
            doc = self._reader.next()
            if doc is None:
                break
            if doc[1] and self._cfg.non_utf8 == "skip":
                continue
            texts.append(doc[0])
        self._window_state[w + 1] = self._reader.state()
        self._reader_window = w + 1
        eos = np.array([self._eos], np.int64)
        docs = [np.concatenate([ids, eos]) for ids in self._tokenize(texts)] if texts else []
        perm = feistel_permute(np.arange(len(docs)), len(docs), (self._cfg.seed << 20) + w) \
            if docs else []
        return [docs[int(i)] for i in perm]

    def release(self, low_block: int) -> None:
        for old in [x for x in self._window_state if x < low_block]:
            del self._window_state[old]

    def get_state(self, min_doc: int) -> dict[str, Any]:
        w = min_doc // self.block_size
        return {"window": w, "reader": self._window_state[w]}

    def set_state(self, state: dict[str, Any]) -> None:
        self._window_state = {int(state["window"]): state["reader"]}
        self._reader, self._reader_window = None, -1

    def epoch(self, doc: int, min_doc: int) -> int:
        return self._window_state[min_doc // self.block_size]["next_file"] // self._files.per_epoch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


def make_streaming_iterator(cfg: DataConfig, *, process_index: int, process_count: int,
                            start_step: int = 0) -> grain.DatasetIterator:
    """Host-local batches from ``cfg.source`` files, tokenized on the fly (checkpointable)."""
    if sources_lib.is_builtin(cfg.source) or cfg.source.startswith("tfds:"):
        raise ValueError(f"streaming mode reads files; source {cfg.source!r} is not a file "
                         "source (prepare it instead)")
    rows = host_rows(cfg.global_batch_size, process_count)
    paths = sources_lib.list_files(cfg.source)
    if all(sources_lib.file_size(p) == 0 for p in paths):
        raise sources_lib.SourceError(f"streaming: source {cfg.source!r}: no documents (all "
                                      f"{len(paths)} files are empty)")
    files = HostFiles(paths, cfg.seed, process_index, process_count, cfg.num_epochs)
    tok = tok_lib.get_tokenizer(cfg.tokenizer, cfg.data_dir)
    start_file = 0
    if start_step:
        texts: list[str] = []
        for f in range(files.per_epoch):  # the first host file with documents (skip empty ones)
            texts = [t for t, _ in sources_lib.iter_source_file(
                files[f], sources_lib.SkippedFiles(), text_field=cfg.text_field,
                text_delimiter=cfg.text_delimiter)]
            if texts:
                break
        n_tokens = sum(len(x) + 1 for x in tok.encode_batch(texts)) if texts else 0
        start_file = int(start_step * rows * (cfg.seq_len + 1) // max(1, n_tokens))
    ds: grain.IterDataset = packing_lib.PackedDataset(
        lambda: StreamingBlocks(cfg, files, eos_id=tok.eos_id, start_file=start_file),
        rows=rows, width=cfg.seq_len + 1, packing=cfg.packing, eos_id=tok.eos_id,
        max_carry=cfg.first_fit_bins or rows,
        row_shuffle=cfg.row_shuffle_window, seed=cfg.seed)
    if cfg.prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
    return iter(ds)
