"""Mixtures: named components (each a prepared data dir, or a source prepared into its own
cache dir), sampled per row with weights that may change with the step.

``DataConfig.mixture = {name: spec}``, spec = a prepared data dir (it holds ``manifest.json``)
or a source spec (prepared into ``default_data_dir(source, ...)``, as a single source is), or
a dict ``{"data_dir", "source", "tokenizer", "seq_len"}``. ``DataConfig.mixture_weights`` =
``((step, {name: weight}), ...)``: the stage with the largest start ``<= s`` weighs data step
``s`` (the batch trained at step ``s + 1``); the first stage starts at 0.

Sampling (``MixturePicker``): global row ``(s, r)`` draws on component ``c`` where a seeded
hash of (seed, s, r) falls in ``c``'s share of the weights in force at ``s``, then takes the
next row of that component's packed sub-stream of data stream ``r`` (``host_streams.py``). The
choice depends on nothing else, so the state is the sub-streams' positions (exact resume on
any host count), and the rows drawn per component up to any step are a pure function of the
config (``tokens_drawn``: the ``data/<component>/tokens`` the trainer logs).
"""

from __future__ import annotations

import zlib
from typing import Any

import grain
import numpy as np

from ode_lm.data import host_streams as streams_lib
from ode_lm.data import manifest as prep
from ode_lm.data import pipeline
from ode_lm.data.config import DataConfig
from ode_lm.data.config import check_mixture as check_config  # noqa: F401 - settings: config.py
from ode_lm.data.config import mixture_components as components
from ode_lm.data.prepare import ensure_prepared as prepare_one
from ode_lm.data.shuffle import _mix


def check_manifests(manifests: list[tuple[str, dict[str, Any]]]) -> None:
    """Prepared components agree on the tokenizer and vocabulary (one line naming both)."""
    first_name, first = manifests[0]
    for name, m in manifests[1:]:
        for key in ("sha256", "vocab_size", "eos_id"):
            if m["tokenizer"][key] != first["tokenizer"][key]:
                raise prep.PreparedDataError(
                    f"DataConfig.mixture: components {first_name!r} ({first['data_dir']}) and "
                    f"{name!r} ({m['data_dir']}) disagree on tokenizer {key} "
                    f"({first['tokenizer'][key]!r} vs {m['tokenizer'][key]!r})")


class MixturePicker:
    """``streams.RowPicker`` of a mixture: component of global row (s, r), from (seed, s, r)."""

    def __init__(self, cfg: DataConfig) -> None:
        self.names = list(cfg.mixture)
        stages = cfg.mixture_weights or ((0, dict.fromkeys(self.names, 1.0)),)
        self.starts = np.array([s for s, _ in stages], np.int64)
        w = np.array([[float(ws[n]) for n in self.names] for _, ws in stages])
        self.cum = np.cumsum(w / w.sum(axis=1, keepdims=True), axis=1)
        self.cum[:, -1] = 1.0
        self.rows, self.key = cfg.global_batch_size, (cfg.seed << 8) + 0x4D49

    def uniform(self, steps: np.ndarray, rows: np.ndarray) -> np.ndarray:
        x = (np.asarray(steps, np.uint64)[:, None] * np.uint64(self.rows)
             + np.asarray(rows, np.uint64)[None, :])
        with np.errstate(over="ignore"):
            return (_mix(x, self.key) >> np.uint64(11)).astype(np.float64) / float(1 << 53)

    def choose_many(self, steps: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``[len(steps), len(rows)]`` component indices."""
        stage = np.searchsorted(self.starts, np.asarray(steps, np.int64), side="right") - 1
        u = self.uniform(steps, rows)
        cum = self.cum[stage]  # [S, C]
        return (u[:, :, None] >= cum[:, None, :]).sum(axis=2)

    def choose(self, step: int, rows: np.ndarray) -> np.ndarray:
        return self.choose_many(np.array([step]), rows)[0]


def rows_drawn(cfg: DataConfig, steps: int, *, start: int = 0, picker: MixturePicker | None = None,
               rows: np.ndarray | None = None, chunk: int = 1024) -> np.ndarray:
    """Rows each component gave data steps ``[start, steps)``, summed over ``rows`` (default:
    the whole batch)."""
    picker = picker or MixturePicker(cfg)
    counts = np.zeros(len(picker.names), np.int64)
    rows = np.arange(cfg.global_batch_size) if rows is None else rows
    for lo in range(start, steps, chunk):
        picks = picker.choose_many(np.arange(lo, min(steps, lo + chunk)), rows)
        counts += np.bincount(picks.ravel(), minlength=len(counts))
    return counts


class TokenCount:
    """``data/<component>/tokens`` after ``step`` train steps (cumulative, incremental)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.names = cfg, list(getattr(cfg, "mixture", None) or {})
        self._picker = MixturePicker(cfg) if self.names else None
        self._step, self._rows = 0, np.zeros(len(self.names), np.int64)

    def __call__(self, step: int) -> dict[str, float]:
        if self._picker is None:
            return {}
        if step < self._step:
            self._step, self._rows = 0, np.zeros(len(self.names), np.int64)
        if step > self._step:
            self._rows += rows_drawn(self.cfg, step, start=self._step, picker=self._picker)
            self._step = step
        return {f"data/{n}/tokens": float(r * self.cfg.seq_len)
                for n, r in zip(self.names, self._rows, strict=True)}


def component_seed(cfg: DataConfig, name: str) -> int:
    """Each component's own document order (its name keys it)."""
    return (cfg.seed ^ zlib.crc32(name.encode())) & 0xFFFFFFFF


# ------------------------------------------------------------------- data pipeline side


def ensure_prepared(cfg: DataConfig) -> dict[str, Any]:
    """Every component prepared (process 0 first: the trainer's ``prepare_data_once``) and
    checked to agree; returns the first component's manifest."""
    manifests = [(name, prepare_one(c)) for name, c in components(cfg)]
    check_manifests(manifests)
    return manifests[0][1]


def make_mixture_iterator(cfg: DataConfig, *, process_index: int, process_count: int,
                          start_step: int = 0, split: str = "train"):
    """Host-local batches of a mixture: per data stream one packed sub-stream per component,
    rows picked by ``MixturePicker`` (module docstring)."""
    streams = streams_lib.host_streams(cfg.global_batch_size, process_index, process_count)
    comps = components(cfg)
    picker = MixturePicker(cfg)
    per_stream = (rows_drawn(cfg, start_step, picker=picker) // cfg.global_batch_size
                  if start_step else np.zeros(len(comps), np.int64))
    makers = []
    for i, (name, c) in enumerate(comps):
        manifest, records = pipeline.open_split(c, split)
        makers.append(pipeline.stream_packers(
            c, records, manifest, split=split, streams=streams, seed=component_seed(cfg, name),
            salt=i + 1, start_step=int(per_stream[i])))
    ds = streams_lib.StreamsDataset(
        make_packer=lambda c, v: makers[c](c, v), names=[n for n, _ in comps], streams=streams,
        num_streams=cfg.global_batch_size, picker=picker, start_step=start_step)
    if cfg.prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
    return iter(ds)
