"""Shared helpers for the data tests: one prepared built-in corpus per test process."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile

from ode_lm.data import DataConfig, ensure_prepared

_CACHE: dict[str, DataConfig] = {}
_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="ode_lm_data_tests_"))


def builtin_config(tokenizer: str = "bpe:1024", **overrides) -> DataConfig:
    """The built-in corpus, prepared once per process (holdout 5% so validation is sizeable)."""
    key = tokenizer
    if key not in _CACHE:
        cfg = DataConfig(data_dir=str(_ROOT / tokenizer.replace(":", "-")), tokenizer=tokenizer,
                         holdout_fraction=0.05, seq_len=64, global_batch_size=8, prefetch=0)
        ensure_prepared(cfg)
        _CACHE[key] = cfg
    return dataclasses.replace(_CACHE[key], **overrides)


def write_jsonl(path: pathlib.Path, texts: list[str], field: str = "text") -> pathlib.Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def small_texts(n: int = 60) -> list[str]:
    """Deterministic synthetic documents of varied lengths."""
    words = "ode vector field time embedding solver steps mesh shard token".split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + (i * 13) % 40)) + f" #{i}"
            for i in range(n)]
