"""``manifest.json`` of a prepared data dir: reading it and the cheap checks run when it is opened.

Opening a data dir (``load_manifest``, ``ensure_prepared``, the train/eval pipelines) refuses,
with one line naming the file and field, what would otherwise fail later deep inside a
pipeline worker or silently train on the wrong data:

* ``load_manifest``: the JSON itself (format, required fields, per-split counts equal to the
  sums over their shards, dtype and EOS consistent with ``tokenizer.vocab_size``);
* ``check_tokenizer``: the data dir's tokenizer (``tokenizer.json`` or the spec) has the
  manifest's sha256, ``vocab_size`` and ``eos_id``;
* ``check_settings``: the configured preparation settings (source, holdout, ...) are the
  manifest's;
* ``source_changes``: the local source files are those it was prepared from (their sizes
  and modification times, and no file added to a glob or directory);
* ``shard_paths`` / ``verify_shards``: every shard exists with the recorded byte size and
  ArrayRecord record count (a truncated or corrupted shard opens with 0 records).

Every check only reads; a failing one leaves the data dir byte-for-byte unchanged.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from ode_lm.data import sources as sources_lib
from ode_lm.data import tokenizers as tok_lib

FORMAT = "ode_lm.data/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
_VERIFIED: set[tuple[str, int, int]] = set()  # (path, bytes, mtime) of shards already checked
_MISSING = object()


class PreparedDataError(ValueError):
    """Prepared data missing, inconsistent, truncated, or tokenized differently."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _field(m: dict[str, Any], path: str, p: epath.Path, kind: type | tuple[type, ...]) -> Any:
    node: Any = m
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise PreparedDataError(f"{p}: missing field {path!r}")
        node = node[key]
    if not isinstance(node, kind) or isinstance(node, bool):
        name = getattr(kind, "__name__", "a number")
        raise PreparedDataError(f"{p}: field {path!r} is {node!r}, not {name}")
    return node


def _check_structure(m: dict[str, Any], p: epath.Path) -> None:
    """Counts and types the pipelines rely on, all from the manifest alone."""
    vocab = _field(m, "tokenizer.vocab_size", p, int)
    eos = _field(m, "tokenizer.eos_id", p, int)
    _field(m, "tokenizer.spec", p, str)
    _field(m, "tokenizer.sha256", p, str)
    dtype = _field(m, "dtype", p, str)
    if not 0 <= eos < vocab:
        raise PreparedDataError(f"{p}: tokenizer.eos_id={eos} is outside tokenizer.vocab_size="
                                f"{vocab}; the manifest was edited or is damaged")
    if dtype != token_dtype(vocab).str:
        raise PreparedDataError(f"{p}: dtype={dtype!r} does not match tokenizer.vocab_size={vocab} "
                                f"(expected {token_dtype(vocab).str!r}); the manifest was edited "
                                "or is damaged")
    for split in SPLITS:
        docs = _field(m, f"splits.{split}.documents", p, int)
        tokens = _field(m, f"splits.{split}.tokens", p, int)
        shards = _field(m, f"splits.{split}.shards", p, list)
        for i, s in enumerate(shards):
            for key, kind in (("path", str), ("documents", int), ("tokens", int)):
                if not isinstance(s, dict) or not isinstance(s.get(key), kind):
                    raise PreparedDataError(f"{p}: field 'splits.{split}.shards[{i}].{key}' is "
                                            "missing or invalid")
        for key, total in (("documents", docs), ("tokens", tokens)):
            held = sum(s[key] for s in shards)
            if held != total:
                raise PreparedDataError(
                    f"{p}: splits.{split}.{key}={total} but its shards hold {held} (sum of "
                    f"splits.{split}.shards[*].{key}); the manifest was edited or is damaged")
        if tokens < docs:
            raise PreparedDataError(f"{p}: splits.{split}.tokens={tokens} is fewer than its "
                                    f"{docs} documents (each ends in EOS); the manifest was edited")


def manifest_path(data_dir: str | os.PathLike) -> str:
    """``<data_dir>/manifest.json``: the one place the file's name is spelled."""
    return os.fspath(epath.Path(data_dir) / MANIFEST)


def has_manifest(data_dir: str | os.PathLike | None) -> bool:
    """Whether ``data_dir`` is a prepared data dir (its manifest exists; nothing checked)."""
    return bool(data_dir) and epath.Path(manifest_path(data_dir)).exists()


def load_manifest(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared dir, with ``vocab_size``/``eos_id``/``dtype`` at top level."""
    p = epath.Path(data_dir) / MANIFEST
    if not p.exists():
        raise PreparedDataError(f"{p} not found: prepare the data first "
                                "(ode-lm prepare or ode_lm.data.ensure_prepared)")
    try:
        m = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreparedDataError(f"{p}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise PreparedDataError(f"{p}: format {got!r}, expected {FORMAT!r}")
    _check_structure(m, p)
    m["vocab_size"] = m["tokenizer"]["vocab_size"]
    m["eos_id"] = m["tokenizer"]["eos_id"]
    m["data_dir"] = os.fspath(data_dir)
    return m


def _manifest_path(manifest: dict[str, Any]) -> str:
    return manifest_path(manifest["data_dir"])


def check_tokenizer(manifest: dict[str, Any], spec: str | None) -> None:
    """Refuses data tokenized by another tokenizer than the configured one (spec, file hash),
    and a manifest whose vocab_size/eos_id are not the data dir's tokenizer's. ``spec=None``
    checks the manifest against its own tokenizer."""
    rec = manifest["tokenizer"]
    if spec and spec != rec["spec"]:
        raise PreparedDataError(f"{manifest['data_dir']}: data was tokenized with {rec['spec']!r}, "
                                f"config says tokenizer={spec!r}")
    spec = spec or rec["spec"]
    tok = tok_lib.get_tokenizer(spec, manifest["data_dir"])
    if tok.fingerprint != rec["sha256"]:
        raise PreparedDataError(f"{manifest['data_dir']}: tokenizer {spec!r} hash "
                                f"{tok.fingerprint[:12]} does not match the manifest's "
                                f"{rec['sha256'][:12]}")
    where = tok.file or spec
    for key in ("vocab_size", "eos_id"):
        if rec[key] != getattr(tok, key):
            raise PreparedDataError(f"{_manifest_path(manifest)}: tokenizer.{key}={rec[key]} but "
                                    f"the tokenizer {spec!r} ({where}) has {key}="
                                    f"{getattr(tok, key)}; the manifest was edited or is damaged")


def manifest_settings(manifest: dict[str, Any]) -> dict[str, Any]:
    """The preparation settings a manifest records, by ``DataConfig`` field name (only those
    it has: older manifests may lack some)."""
    src, holdout = manifest.get("source") or {}, manifest.get("holdout") or {}
    found = {"source": src.get("spec", _MISSING), "text_field": src.get("text_field", _MISSING),
             "text_delimiter": src.get("text_delimiter", _MISSING),
             "non_utf8": (manifest.get("non_utf8") or {}).get("policy", _MISSING),
             "holdout_fraction": holdout.get("fraction", _MISSING),
             "holdout_seed": holdout.get("seed", _MISSING)}
    return {k: v for k, v in found.items() if v is not _MISSING}


def _compared_settings(manifest: dict[str, Any], streaming: bool) -> list[str]:
    """Settings that decide the data dir's contents: ``text_delimiter`` only for .txt files,
    ``text_field`` only for jsonl/parquet/tfds; streaming mode trains on ``source`` itself and
    uses the data dir for its validation split only, so there only the holdout counts."""
    if streaming:
        return ["holdout_fraction", "holdout_seed"]
    src = manifest.get("source") or {}
    spec = src.get("spec") or ""
    kinds: set[str] = set()
    if spec.startswith("tfds:"):
        kinds = {"tfds"}
    elif not sources_lib.is_builtin(spec):
        for f in src.get("files") or []:
            try:
                kinds.add(sources_lib.file_kind(f))
            except sources_lib.SourceError:
                pass
    keys = ["source", "non_utf8", "holdout_fraction", "holdout_seed"]
    keys += ["text_field"] if kinds - {"text"} else []
    keys += ["text_delimiter"] if "text" in kinds else []
    return keys


def check_settings(manifest: dict[str, Any], cfg: Any) -> None:
    """The configured preparation settings must be those the data dir was prepared with
    (the tokenizer is ``check_tokenizer``'s): a dir prepared earlier with another holdout,
    source or text field is refused, naming the field and both values."""
    have = manifest_settings(manifest)
    for key in _compared_settings(manifest, bool(getattr(cfg, "streaming", False))):
        want = getattr(cfg, key)
        if key in have and have[key] != want:
            raise PreparedDataError(
                f"{_manifest_path(manifest)}: prepared with {key}={have[key]!r}, but "
                f"DataConfig.{key}={want!r}; set DataConfig.{key}={have[key]!r}, or use another "
                "data_dir (data_dir=None picks a cache dir keyed by the settings)")


def source_changes(manifest: dict[str, Any]) -> str | None:
    """What changed in the local source files since the data dir was prepared from them (a
    file grown, rewritten or added to the glob/directory), as one line; None when nothing
    did, when the manifest records no file stamps, or when the source is gone (prepared data
    stands on its own)."""
    source = manifest.get("source") or {}
    stamps = source.get("file_stamps")
    if not stamps:
        return None
    where = f"{manifest['data_dir']} was prepared from {source['spec']!r}"
    for path, (size, mtime) in sorted(stamps.items()):
        now = sources_lib.file_stamp(path)
        if now is None or now == [size, mtime]:
            continue
        what = (f"{size} bytes, now {now[0]}" if now[0] != size
                else "same size, modified since")
        return f"{where}, whose file {path} changed since ({what})"
    try:
        files = sources_lib.list_files(source["spec"])
    except (sources_lib.SourceError, OSError):
        return None
    added = [f for f in files if f not in set(source.get("files") or ()) and "://" not in f]
    if added:
        more = f" and {len(added) - 1} more" if len(added) > 1 else ""
        return f"{where}, which now also holds {added[0]}{more}"
    return None


def _check_shard(root: epath.Path, s: dict[str, Any]) -> str:
    p = root / s["path"]
    if not p.exists():
        raise PreparedDataError(f"shard {p} is missing")
    st = p.stat()
    if "bytes" in s and st.length != s["bytes"]:
        raise PreparedDataError(f"shard {p} is truncated or changed: {st.length} bytes, "
                                f"manifest says {s['bytes']}")
    mtime = os.stat(p).st_mtime_ns if "://" not in os.fspath(p) else int(st.mtime or 0)
    key = (os.fspath(p), int(st.length), mtime)
    if key in _VERIFIED:
        return os.fspath(p)
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(os.fspath(p), "readahead_buffer_size:0")
        n = reader.num_records()
        reader.close()
    except Exception as e:  # noqa: BLE001 - riegeli raises plain RuntimeError/ValueError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PreparedDataError(f"shard {p} is unreadable (truncated or corrupt?): {msg}") from None
    if n != s["documents"]:
        raise PreparedDataError(f"shard {p} is truncated or corrupt: {n} records, manifest says "
                                f"{s['documents']}")
    _VERIFIED.add(key)
    return os.fspath(p)


def shard_paths(manifest: dict[str, Any], split: str) -> list[str]:
    """Absolute shard paths of a split, after checking each shard (exists, byte size, record
    count) against the manifest."""
    if split not in manifest["splits"]:
        raise PreparedDataError(f"{manifest['data_dir']}: no split {split!r} "
                                f"(have {sorted(manifest['splits'])})")
    root = epath.Path(manifest["data_dir"])
    shards = manifest["splits"][split]["shards"]
    if len(shards) <= 4:
        return [_check_shard(root, s) for s in shards]
    with cf.ThreadPoolExecutor(min(16, len(shards))) as pool:  # gs:// round trips overlap
        return list(pool.map(lambda s: _check_shard(root, s), shards))


def verify_shards(manifest: dict[str, Any], splits: Sequence[str] = SPLITS) -> None:
    """``shard_paths`` for every split: what opening the data dir checks up front."""
    for split in splits:
        shard_paths(manifest, split)
