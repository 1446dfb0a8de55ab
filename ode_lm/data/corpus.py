"""The built-in corpus: docstrings of the Python standard library (~1.5 MB of English).

It exists wherever Python does, needs no download, and is the same byte for byte on every
machine with the same Python version: modules are read in sorted path order and *parsed*
with ``ast`` (never imported, so no side effects); docstrings are taken in ``ast.walk``
order with ``inspect.cleandoc`` applied. Tests and the demo use it.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
import tempfile
import warnings

# Packages skipped: tests, GUIs/demos and the vendored 2to3 grammar (code, not prose).
_SKIP_PARTS = frozenset({
    "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "__pycache__",
    "site-packages", "dist-packages", "ensurepip", "pydoc_data",
})
MIN_CHARS = 40  # docstrings shorter than this are mostly "Return x." noise


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _module_files(root: pathlib.Path) -> list[pathlib.Path]:
    files = [p for p in root.rglob("*.py") if not _SKIP_PARTS & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _docstrings(source: bytes) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_CHARS:
                out.append(doc)
    return out


def _cache_path(root: pathlib.Path) -> pathlib.Path:
    base = os.environ.get("ODE_LM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(tempfile.gettempdir()), "ode_lm_cache"
    )
    key = hashlib.sha1(f"{sys.version}|{root}|v1".encode()).hexdigest()[:16]
    return pathlib.Path(base) / f"stdlib_docstrings-{key}.jsonl.gz"


@functools.lru_cache(maxsize=1)
def builtin_documents() -> tuple[str, ...]:
    """All documents of the built-in corpus, in their fixed order (cached on disk, ~10 s once)."""
    root = stdlib_root()
    cache = _cache_path(root)
    if cache.exists():
        try:
            with gzip.open(cache, "rt", encoding="utf-8") as f:
                return tuple(json.loads(line) for line in f)
        except (OSError, EOFError, json.JSONDecodeError):
            pass  # rebuilt below
    docs: list[str] = []
    for path in _module_files(root):
        docs.extend(_docstrings(path.read_bytes()))
    if not docs:
        raise RuntimeError(f"built-in corpus: no docstrings found under {root}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    os.replace(tmp, cache)
    return tuple(docs)
