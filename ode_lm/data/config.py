"""``DataConfig``: every knob of the input pipelines.

A plain dataclass: the trainer registers it with gin, nothing in ``ode_lm.data`` imports gin.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile

from ode_lm.config_types import (
    check_types,
    require,
    require_at_least,
    require_fraction,
    require_one_of,
)
from ode_lm.errors import SettingError

PACKINGS = ("concat", "first_fit")
NON_UTF8 = ("replace", "skip")  # a document that is not UTF-8: U+FFFD, or skip it


def default_data_dir(source: str = "builtin", tokenizer: str = "bpe:4096",
                     holdout_fraction: float = 0.0005, holdout_seed: int = 2357) -> str:
    """A cache dir keyed by what decides the prepared data ($ODE_LM_CACHE or /tmp)."""
    base = os.environ.get("ODE_LM_CACHE") or os.path.join(tempfile.gettempdir(), "ode_lm_cache")
    key = hashlib.sha1(f"{source}|{tokenizer}|{holdout_fraction}|{holdout_seed}".encode())
    name = re.sub(r"[^A-Za-z0-9]+", "-", f"{source[-24:]}-{tokenizer[-24:]}").strip("-")
    return os.path.join(base, "data", f"{name}-{key.hexdigest()[:8]}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline settings.

    Prepared batches depend only on (data, tokenizer, seq_len, global_batch_size, packing,
    seed, first_fit_bins, row_shuffle_window) and the step, never on the host count (data
    streams: ``host_streams.py``); thread/worker/prefetch counts never change them. Streaming
    batches also depend on the host count.
    """

    # --- where the data is and how it was / is tokenized ---
    # prepared shards + manifest.json; None = a cache dir keyed by source/tokenizer/holdout
    data_dir: str | None = None
    source: str = "builtin"          # raw source spec (ode_lm.data.sources): prepare/streaming
    tokenizer: str = "bpe:4096"      # tokenizer spec (see ode_lm.data.tokenizers)
    text_field: str = "text"         # jsonl/parquet/tfds field holding the text
    text_delimiter: str | None = None  # .txt: None = one document per file
    non_utf8: str = "replace"        # 'replace' (U+FFFD) or 'skip' the document; both counted
    holdout_fraction: float = 0.0005  # validation fraction (document-content hash rule)
    holdout_seed: int = 2357
    docs_per_shard: int = 20_000     # preparation: documents per input chunk (= output shard pair)
    # a mixture (ode_lm.data.mixture): {name: data dir | source spec | {data_dir, source,
    # tokenizer, seq_len}}, each row drawing on one component by the weights in force
    mixture: dict | None = None
    # ((start step, {name: weight}), ...): staged weights; () = equal weights
    mixture_weights: tuple = ()
    # --- batches ---
    seq_len: int = 256
    global_batch_size: int = 8
    seed: int = 0
    packing: str = "concat"          # 'concat' (concat-then-split) | 'first_fit'
    first_fit_bins: int = 0          # first_fit: pieces a stream carries to its next row (0 = 8)
    num_epochs: int | None = None    # None = repeat forever (each epoch reshuffled)
    # rows in flight, shared over the data streams (each packs and shuffles
    # max(ceil(window / global_batch_size), min(window, 16)) of its rows at once), so a row's
    # neighbours in time are not one long document cut into consecutive rows; 0 = off.
    # Streaming: rows per host, packed together and shuffled (packing.py)
    row_shuffle_window: int = 4096
    # --- throughput (never change the batches) ---
    num_threads: int = 2             # record-reading / tokenizing threads
    prefetch: int = 2                # batches prefetched by a background thread (0 = none)
    num_workers: int = 0             # streaming: tokenizer processes (0 = threads in-process)
    # --- eval ---
    eval_batch_size: int | None = None  # global; None = global_batch_size
    eval_max_batches: int | None = None  # None = the whole split; else a fixed prefix of it
    # --- streaming mode (unprepared sources) ---
    streaming: bool = False
    shuffle_window: int = 1024       # documents in the streaming window shuffle
    interleave_files: int = 4        # files read concurrently per host

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("source", "tokenizer", "text_field"):
            require(self, name, bool(getattr(self, name).strip()), "must not be empty")
        require(self, "text_delimiter", self.text_delimiter != "",
                "must not be empty (None: one document per file)")
        require(self, "data_dir", "://" in (self.data_dir or "") or not (
            self.data_dir and os.path.isfile(self.data_dir)), "is a file, not a directory")
        require_one_of(self, "non_utf8", NON_UTF8)
        require_one_of(self, "packing", PACKINGS)
        require_fraction(self, "holdout_fraction")
        require_at_least(self, 1, "docs_per_shard", "seq_len", "global_batch_size", "num_epochs",
                         "num_threads", "eval_batch_size", "eval_max_batches",
                         "interleave_files")
        require_at_least(self, 0, "holdout_seed", "first_fit_bins", "row_shuffle_window",
                         "prefetch", "num_workers", "shuffle_window")
        require(self, "seed", 0 <= self.seed < 2**32, "must be in [0, 2^32)")
        require(self, "mixture_weights", self.mixture is not None or not self.mixture_weights,
                "staged weights without a DataConfig.mixture")
        if self.mixture is not None:
            self._check_mixture()
        if not self.data_dir:
            object.__setattr__(self, "data_dir", default_data_dir(
                self.source, self.tokenizer, self.holdout_fraction, self.holdout_seed))

    def _check_mixture(self) -> None:
        require(self, "mixture", isinstance(self.mixture, dict) and bool(self.mixture),
                "expected a dict {name: data dir or source spec}")
        require(self, "mixture", not self.streaming,
                "streaming mixtures are not supported (prepare the components)")
        check_mixture(self)
        if not self.data_dir:  # the first component's: its tokenizer is the run's
            object.__setattr__(self, "data_dir", mixture_components(self)[0][1].data_dir)

    @property
    def eval_global_batch_size(self) -> int:
        return self.eval_batch_size or self.global_batch_size


_SPEC_KEYS = {"data_dir", "source", "tokenizer", "seq_len"}


def mixture_components(cfg: DataConfig) -> list[tuple[str, DataConfig]]:
    """``[(name, its single-source DataConfig)]`` in the mixture's order (ode_lm.data.mixture
    samples them; here because DataConfig checks them when it is built)."""
    from ode_lm.data.manifest import MANIFEST
    out = []
    for name, spec in (cfg.mixture or {}).items():
        if isinstance(spec, str):  # a prepared dir brings its source and tokenizer
            manifest = os.path.join(spec, MANIFEST)
            if os.path.exists(manifest):
                with open(manifest) as f:
                    m = json.load(f)
                spec = {"data_dir": spec, "source": m["source"]["spec"],
                        "tokenizer": m["tokenizer"]["spec"]}
            else:
                spec = {"source": spec}
        bad = set(spec) - _SPEC_KEYS if isinstance(spec, dict) else {"?"}
        if bad:
            raise SettingError(f"DataConfig.mixture[{name!r}]={spec!r}: expected a data dir, a "
                             f"source spec or a dict with keys {sorted(_SPEC_KEYS)}")
        source = spec.get("source", cfg.source)
        tokenizer = spec.get("tokenizer", cfg.tokenizer)
        data_dir = spec.get("data_dir") or default_data_dir(
            source, tokenizer, cfg.holdout_fraction, cfg.holdout_seed)
        out.append((name, dataclasses.replace(
            cfg, mixture=None, mixture_weights=(), source=source, tokenizer=tokenizer,
            data_dir=data_dir, seq_len=spec.get("seq_len", cfg.seq_len))))
    return out


def check_mixture(cfg: DataConfig) -> None:
    """Settings errors, before anything is read: names, weights, tokenizers, seq lengths."""
    comps = mixture_components(cfg)
    first_name, first = comps[0]
    for name, c in comps[1:]:
        for field in ("tokenizer", "seq_len"):
            if getattr(c, field) != getattr(first, field):
                raise SettingError(f"DataConfig.mixture: components {first_name!r} and {name!r} "
                                 f"disagree on {field} ({getattr(first, field)!r} vs "
                                 f"{getattr(c, field)!r})")
    for stage in cfg.mixture_weights:
        if not (isinstance(stage, tuple | list) and len(stage) == 2
                and isinstance(stage[0], int) and not isinstance(stage[0], bool)):
            raise SettingError(f"DataConfig.mixture_weights: stage {stage!r}: expected "
                               "(start step, {name: weight})")
    stages = cfg.mixture_weights or ((0, dict.fromkeys(cfg.mixture, 1.0)),)
    starts = [s for s, _ in stages]
    if starts[0] != 0 or starts != sorted(set(starts)):
        raise SettingError(f"DataConfig.mixture_weights: stage starts {starts} must begin at 0 and "
                         "increase")
    for start, weights in stages:
        if not isinstance(weights, dict) or set(weights) != set(cfg.mixture) or \
                any(not isinstance(w, int | float) or w < 0 for w in weights.values()) or \
                sum(weights.values()) <= 0:
            raise SettingError(f"DataConfig.mixture_weights at step {start}: {weights!r} must "
                             f"weigh every component {sorted(cfg.mixture)} with weights >= 0 "
                             "and a positive sum")
