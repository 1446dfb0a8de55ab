"""Raw document sources: built-in corpus, text, jsonl(.gz/.zst), parquet, TFDS; local, gs://, hf://.

A source spec is one of
  * ``builtin`` - the standard-library docstring corpus (``ode_lm.data.corpus``);
    ``builtin:part=<i>/<n>``: its documents ``i, i + n, ...`` (a corpus split into parts,
    e.g. the components of ``configs/data/mixture_demo.gin``);
  * ``tfds:<name>[?split=train&data_dir=<dir>]`` - read through ``tfds.data_source``;
  * one or more comma-separated paths, globs or directories (local or ``gs://`` through
    ``etils.epath``). Files are typed by extension: ``.txt``, ``.jsonl``/``.json``
    (optionally ``.gz``/``.zst``), ``.parquet``. Directories are searched recursively;
    files are always read in sorted order.
  * ``hf://datasets/<owner>/<name>[/<path or glob>]`` - files of a Hugging Face hub dataset
    repo through ``fsspec.filesystem("hf")`` (``huggingface_hub.HfFileSystem``; the
    ``[hub]`` extra). The repo or a directory in it means its ``.parquet`` files, recursively
    (a repo also holds README/json metadata); a glob or a file is typed by extension as
    above. A revision goes after the name: ``.../<name>@refs%2Fconvert%2Fparquet/...``.

A ``.txt`` file is one document, or, when ``text_delimiter`` is set, several documents
separated by that string (each piece stripped of surrounding newlines, empty pieces
dropped). jsonl and parquet read ``text_field`` (OpenWebText's layout: ``text``).

Documents are yielded as ``(text, bad_utf8)``: undecodable bytes are replaced by U+FFFD and
flagged, so preparation can replace or skip them and count them in the manifest.

Inside a source, a file with no documents (empty, only whitespace or blank lines, no rows) or
one that cannot be read (permissions, I/O, a broken gzip/zstd/parquet file) is skipped with a
warning and counted (``SkippedFiles``; the manifest's ``skipped_files``); a source with no
documents at all is an error naming the source. Malformed content (invalid JSON, a missing
field) is never skipped: it is an error naming the file and line.

Over 400 lines: every kind of source shares the spec parsing, the file walk and the skip
and error rules above, so they stay in one module.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import os
import re
import urllib.parse
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from etils import epath

from ode_lm.data.corpus import builtin_documents

TEXT_EXTS = (".txt",)
JSONL_EXTS = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_EXTS = (".parquet",)
ALL_EXTS = TEXT_EXTS + JSONL_EXTS + PARQUET_EXTS
HUB_PREFIX = "hf://"
HUB_SPEC = re.compile(r"hf://datasets/([^/*?\[]+/[^/*?\[]+)(?:/(.*))?")
HUB_EXTRA = "pip install 'ode-lm[hub]'"
Document = tuple[str, bool]
log = logging.getLogger("ode_lm.data")


class SourceError(ValueError):
    """Bad raw input; the message names the file (and line) at fault."""


class EmptyFileError(SourceError):
    """A source file that holds no documents (skipped inside a source)."""


class UnreadableFileError(SourceError):
    """A source file that cannot be read (skipped inside a source)."""


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged or inaccessible file raises (not malformed content)."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    try:
        import pyarrow

        errors += (pyarrow.ArrowException,)
    except ImportError:
        pass
    return errors


@dataclasses.dataclass
class SkippedFiles:
    """Source files passed over, each warned about and counted once (by path)."""

    reasons: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, path: str, why: str) -> None:
        if path not in self.reasons:
            self.reasons[path] = (kind, why)
            log.warning("source file skipped (%s): %s", kind, why)

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.reasons.values())

    def summary(self) -> dict:
        """The manifest's ``skipped_files``."""
        return {"empty": self.count("empty"), "unreadable": self.count("unreadable"),
                "files": {p: k for p, (k, _) in sorted(self.reasons.items())}}

    def describe(self) -> str:
        first = next(iter(self.reasons.values()), None)
        return (f"{self.count('empty')} empty and {self.count('unreadable')} unreadable files "
                f"skipped" + (f", e.g. {first[1]}" if first else ""))


def file_kind(path: str) -> str:
    name = os.fspath(path).lower()
    for kind, exts in (("jsonl", JSONL_EXTS), ("text", TEXT_EXTS), ("parquet", PARQUET_EXTS)):
        if name.endswith(exts):
            return kind
    raise SourceError(f"{path}: unsupported file type (expected one of {', '.join(ALL_EXTS)})")


def _decode(raw: bytes) -> Document:
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace"), True


def _clean(text: str) -> Document:
    """Lone surrogates (e.g. from JSON escapes) cannot be encoded: replace and flag them."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8"), True


_PART = re.compile(r"builtin:part=(\d+)/(\d+)")


def is_builtin(spec: str) -> bool:
    return spec in ("builtin", "builtin:stdlib") or _builtin_part(spec) is not None


def _builtin_part(spec: str) -> tuple[int, int] | None:
    m = _PART.fullmatch(spec)
    if m is None:
        return None
    i, n = int(m.group(1)), int(m.group(2))
    if not 0 <= i < n:
        raise SourceError(f"source {spec!r}: part {i} of {n} does not exist (0 <= i < n)")
    return i, n


def builtin_source_documents(spec: str) -> list[str]:
    """The built-in corpus, or the part of it a ``builtin:part=i/n`` spec names."""
    docs = builtin_documents()
    part = _builtin_part(spec)
    return docs if part is None else docs[part[0]::part[1]]


def _walk(root: epath.Path) -> Iterator[str]:
    """Recursive listing with ``iterdir`` (epath's GCS backend refuses ``**`` globs)."""
    for p in root.iterdir():
        if p.is_dir():
            yield from _walk(p)
        else:
            yield os.fspath(p)


def is_hub(path: str) -> bool:
    return os.fspath(path).startswith(HUB_PREFIX)


def hub_filesystem(path: str):
    """fsspec's ``hf`` file system (huggingface_hub.HfFileSystem unless another is registered),
    looked up per call so a registered stand-in is honoured; imported only for hf:// paths."""
    import fsspec

    try:
        return fsspec.filesystem("hf")
    except ImportError:
        raise SourceError(f"source {path!r}: hf:// sources need huggingface_hub "
                          f"({HUB_EXTRA})") from None


def _list_hub(part: str) -> list[str]:
    """The files of one hf:// spec: repo/dir -> its parquet files; glob -> matches; file."""
    m = HUB_SPEC.fullmatch(part.rstrip("/"))
    if m is None:
        raise SourceError(f"source {part!r}: expected hf://datasets/<owner>/<name>[/<path glob>]")
    fs, part = hub_filesystem(part), m[0]
    try:
        if m[2] and any(c in m[2] for c in "*?["):
            found = [p for p, info in fs.glob(part, detail=True).items()
                     if info.get("type") == "file"]
            what = "the glob matches no files"
        elif fs.isdir(part):
            found = [p for p in fs.find(part) if p.lower().endswith(PARQUET_EXTS)]
            what = "no .parquet files in it"
        elif fs.exists(part):
            found, what = [part], ""
        else:
            raise SourceError(f"source {part!r}: no such repo, file or directory on the hub")
    except SourceError:
        raise
    except Exception as e:  # noqa: BLE001 - network and hub client errors of many types
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise SourceError(f"source {part!r}: listing on the Hugging Face hub failed "
                          f"({type(e).__name__}: {msg})") from None
    if not found:
        raise SourceError(f"source {part!r}: {what}")
    return [HUB_PREFIX + p.removeprefix(HUB_PREFIX) for p in found]


def open_file(path: str) -> BinaryIO:
    """A source file opened for binary reading: hf:// through fsspec, else ``etils.epath``."""
    if is_hub(path):
        return hub_filesystem(path).open(path, "rb")
    return epath.Path(path).open("rb")  # type: ignore[return-value]


def file_size(path: str) -> int:
    if is_hub(path):
        return int(hub_filesystem(path).size(path))
    return epath.Path(path).stat().length


def file_stamp(path: str) -> list[int] | None:
    """``[bytes, mtime_ns]`` of a local source file (what a data dir records of each file it
    was prepared from, to notice a changed source); None for a remote one or a missing one."""
    if "://" in path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [int(st.st_size), int(st.st_mtime_ns)]


def list_files(spec: str) -> list[str]:
    """The sorted files of a path/glob/dir spec; a one-line error when there are none."""
    files: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if is_hub(part):
            files.extend(_list_hub(part))
            continue
        if any(c in part for c in "*?["):
            j = part[: min(part.index(c) for c in "*?[" if c in part)].rfind("/")
            base, pattern = (part[:j] or "/", part[j + 1:]) if j >= 0 else (".", part)
            matches = [os.fspath(p) for p in epath.Path(base).glob(pattern) if p.is_file()]
            if not matches:
                raise SourceError(f"source {part!r}: the glob matches no files")
            files.extend(matches)
            continue
        path = epath.Path(part)
        if not path.exists():
            raise SourceError(f"source {part!r}: no such file or directory")
        if path.is_dir():
            found = [f for f in _walk(path) if f.lower().endswith(ALL_EXTS)]
            if not found:
                raise SourceError(f"source {part!r}: empty directory "
                                  f"(no {'/'.join(ALL_EXTS)} files)")
            files.extend(found)
        else:
            files.append(os.fspath(path))
    if not files:
        raise SourceError(f"source {spec!r}: no files given")
    for f in files:
        file_kind(f)
    return sorted(dict.fromkeys(files))


def _open_binary(path: str) -> BinaryIO:
    f = open_file(path)
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=f)  # type: ignore[return-value]
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f))  # type: ignore[arg-type]
    return f  # type: ignore[return-value]


def _check_nonempty(path: str) -> None:
    if file_size(path) == 0:
        raise EmptyFileError(f"{path}: empty file")


def iter_text_file(path: str, delimiter: str | None) -> Iterator[Document]:
    _check_nonempty(path)
    with open_file(path) as f:
        text, bad = _decode(f.read())
    if delimiter is None:
        if text.strip():
            yield text, bad
        else:
            raise EmptyFileError(f"{path}: empty file (only whitespace)")
        return
    n = 0
    for piece in text.split(delimiter):
        piece = piece.strip("\r\n")
        if piece.strip():
            n += 1
            yield piece, bad and "\ufffd" in piece
    if n == 0:
        raise EmptyFileError(f"{path}: no documents between delimiters {delimiter!r}")


def iter_jsonl_file(path: str, field: str) -> Iterator[Document]:
    _check_nonempty(path)
    n = 0
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line, bad = _decode(raw)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or field not in obj:
                raise SourceError(f"{path}:{lineno}: missing field {field!r}")
            value = obj[field]
            if not isinstance(value, str):
                raise SourceError(f"{path}:{lineno}: field {field!r} is {type(value).__name__}, "
                                  "not a string")
            text, bad2 = _clean(value)
            n += 1
            yield text, bad or bad2
    if n == 0:
        raise EmptyFileError(f"{path}: no documents (only blank lines)")


def iter_parquet_file(path: str, field: str, skip: int = 0) -> Iterator[Document]:
    """Rows of ``field``; ``skip`` leading rows are passed over by row group (fast resume)."""
    import pyarrow.parquet as pq

    _check_nonempty(path)
    with open_file(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types
            raise UnreadableFileError(f"{path}: not a readable parquet file ({e})") from None
        names = pf.schema_arrow.names
        if field not in names:
            raise SourceError(f"{path}: missing column {field!r} (columns: {names})")
        if pf.metadata.num_rows == 0:
            raise EmptyFileError(f"{path}: parquet file has no rows")
        for rg in range(pf.num_row_groups):
            rows = pf.metadata.row_group(rg).num_rows
            if skip >= rows:
                skip -= rows
                continue
            column = pf.read_row_group(rg, columns=[field]).column(0)
            for value in column.to_pylist()[skip:]:
                if value is None:
                    continue
                yield _decode(value) if isinstance(value, bytes) else _clean(value)
            skip = 0


def iter_file_documents(path: str, *, text_field: str = "text",
                        text_delimiter: str | None = None, skip: int = 0) -> Iterator[Document]:
    """The documents of one file from the ``skip``-th on; empty or unreadable is an error."""
    kind = file_kind(path)
    if kind == "parquet":
        return iter_parquet_file(path, text_field, skip=skip)
    it = iter_text_file(path, text_delimiter) if kind == "text" else \
        iter_jsonl_file(path, text_field)
    for _ in range(skip):
        if next(it, None) is None:
            break
    return it


def iter_source_file(path: str, skipped: SkippedFiles, *, text_field: str = "text",
                     text_delimiter: str | None = None, skip: int = 0) -> Iterator[Document]:
    """``iter_file_documents`` for a file inside a source: an empty or unreadable file ends
    early and is recorded in ``skipped`` (a read error midway keeps the documents before it)."""
    n = 0
    try:
        for doc in iter_file_documents(path, text_field=text_field,
                                       text_delimiter=text_delimiter, skip=skip):
            n += 1
            yield doc
    except GeneratorExit:  # closed early (or at interpreter exit, when the names below may
        raise              # already be None): matched first, so they are never looked up
    except EmptyFileError as e:
        skipped.add("empty", path, str(e))
        return
    except UnreadableFileError as e:
        skipped.add("unreadable", path, str(e))
        return
    except _read_errors() as e:
        where = f" after {skip + n} documents" if skip + n else ""
        msg = " ".join(str(e).split()) or type(e).__name__
        skipped.add("unreadable", path, f"{path}: unreadable{where} ({type(e).__name__}: {msg})")
        return
    if n == 0 and skip == 0:
        skipped.add("empty", path, f"{path}: no documents")


def parse_tfds(spec: str) -> tuple[str, dict[str, str]]:
    body = spec[len("tfds:"):]
    name, _, query = body.partition("?")
    if not name:
        raise SourceError(f"source {spec!r}: expected tfds:<name>[?split=..&data_dir=..]")
    return name, dict(urllib.parse.parse_qsl(query))


def tfds_source(spec: str):
    """``tfds.data_source`` for a locally built (or GCS-hosted) dataset; no TensorFlow needed."""
    import tensorflow_datasets as tfds

    name, opts = parse_tfds(spec)
    try:
        return tfds.data_source(name, split=opts.get("split", "train"),
                                data_dir=opts.get("data_dir"), download=False)
    except Exception as e:  # noqa: BLE001 - tfds raises many types
        msg = f"source {spec!r}: tfds.data_source failed: {e}".splitlines()[0]
        raise SourceError(msg) from None


def iter_tfds(spec: str, field: str) -> Iterator[Document]:
    src = tfds_source(spec)
    if len(src) == 0:
        raise SourceError(f"source {spec!r}: the TFDS split is empty")
    for i in range(len(src)):
        ex = src[i]
        if field not in ex:
            raise SourceError(f"source {spec!r}: example {i} has no feature {field!r}")
        v = ex[field]
        v = v.item() if hasattr(v, "item") and getattr(v, "shape", None) == () else v
        yield _decode(v) if isinstance(v, bytes) else _clean(str(v))


def iter_documents(spec: str, *, text_field: str = "text", text_delimiter: str | None = None,
                   skipped: SkippedFiles | None = None) -> Iterator[Document]:
    """Every document of a source, in its fixed order; empty/unreadable files are skipped
    (recorded in ``skipped``), and a source without any document is an error."""
    if is_builtin(spec):
        for d in builtin_source_documents(spec):
            yield _clean(d)
        return
    if spec.startswith("tfds:"):
        yield from iter_tfds(spec, text_field)
        return
    skipped = SkippedFiles() if skipped is None else skipped
    n = 0
    for path in list_files(spec):
        for doc in iter_source_file(path, skipped, text_field=text_field,
                                    text_delimiter=text_delimiter):
            n += 1
            yield doc
    if n == 0:
        raise SourceError(f"source {spec!r}: no documents ({skipped.describe()})")
