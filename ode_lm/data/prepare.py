"""Offline preparation: raw documents -> tokenized ArrayRecord shards + ``manifest.json``.

Layout of a prepared data dir::

  prepare_settings.json       the settings; a re-run with other settings is refused
  tokenizer.json              only for bpe:<n> (trained on the train split, then reused)
  train-00000.array_record    one record per document: little-endian uint16/uint32 ids + EOS
  validation-00000.array_record
  chunks/00000.json           "chunk 0 is complete" marker with its counts (written last)
  manifest.json               counts per split, shards (records, tokens, bytes), tokenizer spec
                              + sha256, source, skipped_files (empty / unreadable source files)

The source is cut into fixed chunks of ``docs_per_shard`` documents in source order; chunk
``c`` becomes ``train-c`` and ``validation-c``. Every file is written to a temporary name and
renamed, and the chunk marker is written after its shards, so an interrupted run resumes by
redoing only chunks without a valid marker: no duplicate or partial shards, whatever the
number of worker processes.

Holdout rule (independent of workers, hosts and document order): a document goes to
``validation`` iff ``blake2b(utf8(text), key=str(seed), digest_size=8) / 2**64 < fraction``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from etils import epath

from ode_lm.data import sources as sources_lib
from ode_lm.data import tokenizers as tok_lib
from ode_lm.data.config import DataConfig
from ode_lm.data.manifest import (  # noqa: F401 - re-exported: the data dir's reading side
    FORMAT,
    MANIFEST,
    SPLITS,
    PreparedDataError,
    check_settings,
    check_tokenizer,
    load_manifest,
    shard_paths,
    source_changes,
    token_dtype,
    verify_shards,
)

log = logging.getLogger("ode_lm.data.prepare")
_warned_changed: set[str] = set()  # data dirs whose changed source was reported

SETTINGS = "prepare_settings.json"
_SETTING_KEYS = ("source", "tokenizer", "text_field", "text_delimiter", "non_utf8",
                 "holdout_fraction", "holdout_seed", "docs_per_shard")


def is_validation(text: str, fraction: float, seed: int) -> bool:
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


def _write_atomic(path: epath.Path, data: str | bytes) -> None:
    tmp = path.parent / f"{path.name}.tmp{os.getpid()}"
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)


def _is_local(path: str | os.PathLike) -> bool:
    return "://" not in os.fspath(path)


def _write_shard(path: epath.Path, records: list[bytes]) -> int:
    """Writes an ArrayRecord file atomically (locally, then copied for gs://); returns bytes."""
    from array_record.python.array_record_module import ArrayRecordWriter

    local_dir = path.parent if _is_local(path) else epath.Path(tempfile.mkdtemp())
    tmp = local_dir / f"{path.name}.tmp{os.getpid()}"
    writer = ArrayRecordWriter(os.fspath(tmp), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()
    size = tmp.stat().length
    if _is_local(path):
        tmp.replace(path)
    else:
        tmp.copy(path, overwrite=True)
        shutil.rmtree(local_dir, ignore_errors=True)
    return size


_WORKER_TOKENIZERS: dict[tuple[str, str], tok_lib.Tokenizer] = {}


def _worker_tokenizer(spec: str, data_dir: str) -> tok_lib.Tokenizer:
    key = (spec, data_dir)
    if key not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[key] = tok_lib.get_tokenizer(spec, data_dir)
    return _WORKER_TOKENIZERS[key]


def _process_chunk(data_dir: str, chunk: int, docs: list[sources_lib.Document],
                   settings: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Tokenizes one chunk, writes its shards, then its marker; returns the marker."""
    tok = _worker_tokenizer(settings["tokenizer"], data_dir)
    bad = sum(b for _, b in docs)
    if settings["non_utf8"] == "skip":
        docs = [d for d in docs if not d[1]]
    texts = [t for t, _ in docs]
    records: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    tokens = dict.fromkeys(SPLITS, 0)
    eos = np.array([tok.eos_id], np.int64)
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        split = "validation" if is_validation(
            text, settings["holdout_fraction"], settings["holdout_seed"]) else "train"
        arr = np.concatenate([ids, eos]).astype(dtype)
        records[split].append(arr.tobytes())
        tokens[split] += arr.size
    root = epath.Path(data_dir)
    skipped = int(bad) if settings["non_utf8"] == "skip" else 0
    marker: dict[str, Any] = {"chunk": chunk, "non_utf8_documents": int(bad),
                              "skipped_documents": skipped}
    for split in SPLITS:
        name = f"{split}-{chunk:05d}.array_record"
        size = _write_shard(root / name, records[split]) if records[split] else 0
        marker[split] = {"path": name if records[split] else None, "documents": len(records[split]),
                         "tokens": int(tokens[split]), "bytes": int(size)}
    (root / "chunks").mkdir(parents=True, exist_ok=True)
    _write_atomic(root / "chunks" / f"{chunk:05d}.json", json.dumps(marker))
    return marker


def _valid_marker(root: epath.Path, chunk: int) -> dict[str, Any] | None:
    p = root / "chunks" / f"{chunk:05d}.json"
    if not p.exists():
        return None
    try:
        marker = json.loads(p.read_text())
    except json.JSONDecodeError:
        return None
    for split in SPLITS:
        info = marker.get(split) or {}
        if info.get("path") and not ((root / info["path"]).exists()
                                     and (root / info["path"]).stat().length == info["bytes"]):
            return None
    return marker


@contextlib.contextmanager
def _ctrl_c_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while a pool worker may be started: a started process
    keeps the mask through its exec, so the terminal's Ctrl-C (sent to the whole process
    group) reaches only this process, which stops the pool; a press meanwhile is delivered
    when the block ends."""
    import signal

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _ignore_ctrl_c() -> None:
    """A worker's Ctrl-C (the terminal sends it to the whole process group) is the main
    process's to handle: it stops the pool; a worker's own would print a traceback each."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _chunks(docs: Iterable[sources_lib.Document], n: int) -> Iterator[list[sources_lib.Document]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _settings(cfg: DataConfig) -> dict[str, Any]:
    return {"format": FORMAT, **{k: getattr(cfg, k) for k in _SETTING_KEYS}}


def _check_settings(root: epath.Path, settings: dict[str, Any]) -> None:
    p = root / SETTINGS
    if p.exists():
        old = json.loads(p.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            k, (a, b) = next(iter(diff.items()))
            raise PreparedDataError(f"data dir {root} was prepared with {k}={a!r}, not {b!r}; "
                                    "use another data dir or delete it")
    else:
        _write_atomic(p, json.dumps(settings, indent=1))


def _progress(total: int | None, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="doc", desc="prepare", mininterval=1.0)


def _check_inputs(cfg: DataConfig) -> None:
    """The source exists and the tokenizer spec can work (cheap: no document is read)."""
    if not sources_lib.is_builtin(cfg.source) and not cfg.source.startswith("tfds:"):
        sources_lib.list_files(cfg.source)
    if cfg.tokenizer.startswith("bpe:"):
        tok_lib.bpe_vocab_size(cfg.tokenizer)  # trained below, into the data dir
    else:
        tok_lib.get_tokenizer(cfg.tokenizer)


def _existing(root: epath.Path) -> tuple[epath.Path, set[str] | None]:
    """What a failed run must leave: the topmost directory it would create (removed whole),
    or, for a data dir that exists, the paths already in it (anything else is removed)."""
    top = root
    while _is_local(root) and not top.parent.exists() and top.parent != top:
        top = top.parent  # (on gs:// a "directory" is a prefix: only the data dir itself)
    if not root.exists():
        return top, None
    return root, {os.fspath(p.relative_to(root)) for p in _walk(root)}


def _walk(root: epath.Path) -> list[epath.Path]:
    """Every path under ``root``, deepest first (``iterdir``: no recursive glob on gs://)."""
    out: list[epath.Path] = []
    for p in root.iterdir():
        if p.is_dir():
            out.extend(_walk(p))
        out.append(p)
    return out


def _undo(root: epath.Path, before: set[str] | None) -> None:
    """Removes what a failed run wrote: the dirs it made, or the new paths in a user's dir
    (its own files are never touched)."""
    if before is None:
        if root.exists():
            root.rmtree(missing_ok=True)
        return
    for p in _walk(root):
        if os.fspath(p.relative_to(root)) not in before:
            p.rmtree(missing_ok=True) if p.is_dir() else p.unlink(missing_ok=True)


def prepare(cfg: DataConfig, *, num_proc: int | None = None, progress: bool = True,
            log=print) -> dict[str, Any]:
    """Prepares ``cfg.source`` into ``cfg.data_dir`` (idempotent, resumable); returns manifest.

    A run that fails (a bad record, a field the records lack) leaves the data dir as it found
    it: otherwise its settings file would refuse the corrected command. An interrupted run
    (Ctrl-C, a killed process) keeps its finished chunks: the next run resumes them."""
    root = epath.Path(cfg.data_dir)
    if not (root / MANIFEST).exists():
        _check_inputs(cfg)  # before the data dir is made: a refused run leaves nothing
    undo_root, before = _existing(root)
    try:
        return _prepare(cfg, root, num_proc=num_proc, progress=progress, log=log)
    except Exception:
        _undo(undo_root, before)
        raise


def _prepare(cfg: DataConfig, root: epath.Path, *, num_proc: int | None, progress: bool,
             log) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    settings = _settings(cfg)
    _check_settings(root, settings)
    if (root / MANIFEST).exists():
        manifest = load_manifest(root)
        if (change := source_changes(manifest)) is not None:
            raise PreparedDataError(f"{change}: its new documents would not be read; prepare "
                                    f"into a new --data_dir (or delete {root})")
        return manifest
    stamps = _source_stamps(cfg)  # before any document is read
    for stray in list(root.glob("*.tmp*")) + list((root / "chunks").glob("*.tmp*")):
        stray.unlink()  # left by an interrupted run; never referenced by a marker
    start = time.perf_counter()
    skipped = sources_lib.SkippedFiles()  # shared by both passes: each file counted once
    split_docs = lambda: sources_lib.iter_documents(  # noqa: E731
        cfg.source, text_field=cfg.text_field, text_delimiter=cfg.text_delimiter, skipped=skipped)
    if cfg.tokenizer.startswith("bpe:") and not (root / tok_lib.BPE_FILE).exists():
        n = tok_lib.bpe_vocab_size(cfg.tokenizer)
        train_texts = (t for t, bad in split_docs() if not (bad and cfg.non_utf8 == "skip")
                       and not is_validation(t, cfg.holdout_fraction, cfg.holdout_seed))
        tok_lib.train_bpe(train_texts, n, root / tok_lib.BPE_FILE)
        log(f"prepare: trained {cfg.tokenizer} -> {root / tok_lib.BPE_FILE}")
    tok = tok_lib.get_tokenizer(cfg.tokenizer, root)
    dtype = token_dtype(tok.vocab_size).str
    num_proc = max(1, num_proc if num_proc is not None else (os.cpu_count() or 1))
    total = (len(sources_lib.builtin_source_documents(cfg.source))
             if sources_lib.is_builtin(cfg.source) else None)
    bar = _progress(total, progress)
    markers: dict[int, dict[str, Any]] = {}
    pool = None
    if num_proc > 1:
        pool = cf.ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_ignore_ctrl_c)
    pending: dict[cf.Future, int] = {}
    num_docs = 0
    num_chunks = 0
    try:
        for chunk, docs in enumerate(_chunks(split_docs(), cfg.docs_per_shard)):
            num_chunks = chunk + 1
            num_docs += len(docs)
            if (m := _valid_marker(root, chunk)) is not None:
                markers[chunk] = m
            elif pool is None:
                markers[chunk] = _process_chunk(os.fspath(root), chunk, docs, settings, dtype)
            else:
                while len(pending) >= 2 * num_proc:  # bound memory: few chunks in flight
                    done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    for f in done:
                        markers[pending.pop(f)] = f.result()
                with _ctrl_c_blocked():  # a worker started here never sees a Ctrl-C
                    fut = pool.submit(_process_chunk, os.fspath(root), chunk, docs, settings,
                                      dtype)
                pending[fut] = chunk
            if bar is not None:
                bar.update(len(docs))
        for f in cf.as_completed(pending):
            markers[pending[f]] = f.result()
    except BaseException:
        if bar is not None:  # no half bar left above the error line
            bar.leave = False
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if bar is not None:
            bar.close()
    if num_docs == 0:
        raise sources_lib.SourceError(f"source {cfg.source!r}: no documents")
    manifest = _assemble(cfg, tok, dtype, [markers[c] for c in range(num_chunks)], skipped)
    if stamps:
        manifest["source"]["file_stamps"] = stamps
    _write_atomic(root / MANIFEST, json.dumps(manifest, indent=1))
    dt = time.perf_counter() - start
    toks = sum(manifest["splits"][s]["tokens"] for s in SPLITS)
    if skipped.reasons:
        log(f"prepare: {skipped.describe()} ({MANIFEST} skipped_files)")
    log(f"prepare: {num_docs} docs, {toks} tokens in {dt:.1f}s "
        f"({num_docs / dt:,.0f} docs/s, {toks / dt:,.0f} tokens/s) -> {root}")
    return load_manifest(root)


def _assemble(cfg: DataConfig, tok: tok_lib.Tokenizer, dtype: str,
              markers: list[dict[str, Any]], skipped: sources_lib.SkippedFiles) -> dict[str, Any]:
    splits = {}
    for split in SPLITS:
        shards = [dict(m[split]) for m in markers if m[split]["path"]]
        splits[split] = {"documents": sum(s["documents"] for s in shards),
                         "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    return {
        "format": FORMAT,
        "source": _describe_source(cfg),
        "tokenizer": tok_lib.describe(tok),
        "dtype": dtype,
        "holdout": {"fraction": cfg.holdout_fraction, "seed": cfg.holdout_seed,
                    "rule": "validation iff blake2b(utf8(text), key=str(seed), digest_size=8)"
                            " / 2**64 < fraction"},
        "non_utf8": {"policy": cfg.non_utf8,
                     "documents": sum(m["non_utf8_documents"] for m in markers),
                     "skipped": sum(m["skipped_documents"] for m in markers)},
        "skipped_files": skipped.summary(),
        "docs_per_shard": cfg.docs_per_shard,
        "splits": splits,
    }


def _describe_source(cfg: DataConfig) -> dict[str, Any]:
    info: dict[str, Any] = {"spec": cfg.source, "text_field": cfg.text_field,
                            "text_delimiter": cfg.text_delimiter}
    if sources_lib.is_builtin(cfg.source):
        info["python"] = sys.version.split()[0]
        info["documents"] = len(sources_lib.builtin_source_documents(cfg.source))
    elif not cfg.source.startswith("tfds:"):
        info["files"] = sources_lib.list_files(cfg.source)
    return info


def _source_stamps(cfg: DataConfig) -> dict[str, list[int]]:
    """``{file: [bytes, mtime_ns]}`` of the local source files (``source_changes`` compares)."""
    if sources_lib.is_builtin(cfg.source) or cfg.source.startswith("tfds:"):
        return {}
    stamps = {f: sources_lib.file_stamp(f) for f in sources_lib.list_files(cfg.source)}
    return {f: st for f, st in stamps.items() if st is not None}


def ensure_prepared(cfg: DataConfig, **kwargs: Any) -> dict[str, Any]:
    """Prepares ``cfg`` (default: the built-in corpus) unless already done; returns the manifest
    after the checks of ``ode_lm.data.manifest`` (tokenizer, settings, every shard)."""
    if not (epath.Path(cfg.data_dir) / MANIFEST).exists():
        kwargs.setdefault("num_proc", 1)
        kwargs.setdefault("progress", False)
        prepare(cfg, **kwargs)
    manifest = load_manifest(cfg.data_dir)
    check_tokenizer(manifest, cfg.tokenizer)
    check_settings(manifest, cfg)
    verify_shards(manifest)
    change = None if cfg.streaming else source_changes(manifest)
    if change is not None and cfg.data_dir not in _warned_changed:  # flagged, once
        _warned_changed.add(cfg.data_dir)
        log.warning("%s: the data as prepared is used; prepare into a new data dir for the "
                    "new documents", change)
    return manifest
