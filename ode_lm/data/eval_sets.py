"""The eval pipeline: exact, unshuffled, every token of the split counted once.

The split's documents (manifest order, each ending in EOS) form the stream
``S = [EOS] + doc_1 + doc_2 + ...``. Row ``r`` is ``S[r*T : r*T + T + 1]`` (``T = seq_len``):
consecutive rows overlap by one token, so every token of the split is the target of exactly
one counted position, and the first token of each document is predicted from the EOS before
it. The last row is padded (``loss_mask`` 0), rows are grouped into global batches of
``eval_global_batch_size`` (padding rows at the end) and host ``p`` gets rows
``[p*b, (p+1)*b)`` of every global batch. The sum of ``loss_mask`` over all hosts and batches
equals the manifest's token count of the split, so the perplexity is exact over the whole
split (or over the fixed prefix of ``eval_max_batches`` batches, if set). Context is at most
``T`` tokens and restarts at row and document boundaries. Each host holds the split's tokens
in memory (OpenWebText's 0.0005 holdout is ~4.5M tokens, ~36 MB as int64).
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from ode_lm.data import packing as packing_lib
from ode_lm.data.config import DataConfig
from ode_lm.data.host_streams import host_rows
from ode_lm.data.manifest import PreparedDataError, manifest_path
from ode_lm.data.pipeline import open_split, resolve_processes


class EvalStream:
    """The whole split as one token stream with a piece (document) id per token."""

    def __init__(self, cfg: DataConfig, split: str) -> None:
        manifest, records = open_split(cfg, split)
        docs = records.__getitems__(np.arange(len(records)))
        eos = manifest["eos_id"]
        lens = np.array([1] + [len(d) for d in docs], np.int64)  # the leading EOS is piece 0
        self.tokens = np.concatenate([np.array([eos], np.int64)]
                                     + [d.astype(np.int64) for d in docs])
        self.piece_ids = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
        self.eos_id, self.manifest_tokens = eos, manifest["splits"][split]["tokens"]
        if len(self.tokens) - 1 != self.manifest_tokens:
            raise ValueError(f"{cfg.data_dir}: split {split!r} holds {len(self.tokens) - 1} "
                             "tokens, "
                             f"manifest says {self.manifest_tokens}")


def check_eval_split(cfg: DataConfig, manifest: dict[str, Any], split: str = "validation", *,
                     process_count: int | None = None) -> int:
    """Before training: the eval split exists and yields at least one batch (from the manifest
    alone, no pass over the data); returns the number of eval batches. Without this a corpus
    with no validation split would fail only after the last train step."""
    where = manifest_path(manifest["data_dir"])
    info = manifest["splits"].get(split)
    if info is None:
        raise PreparedDataError(f"{where}: no {split!r} split to evaluate on "
                                f"(have {sorted(manifest['splits'])})")
    if info["tokens"] < 1 or info["documents"] < 1:
        frac = (manifest.get("holdout") or {}).get("fraction")
        raise PreparedDataError(
            f"{where}: the {split!r} split is empty (prepared with holdout_fraction={frac}), "
            "but training evaluates on it; prepare with a larger DataConfig.holdout_fraction "
            "into another data_dir")
    if cfg.eval_max_batches is not None and cfg.eval_max_batches < 1:
        raise ValueError(f"DataConfig.eval_max_batches={cfg.eval_max_batches}: must be >= 1 "
                         "(or None for the whole split)")
    _, pc = resolve_processes(None, process_count)
    host_rows(cfg.eval_global_batch_size, pc, "eval_batch_size")
    num_rows = -(-info["tokens"] // cfg.seq_len)
    num_batches = -(-num_rows // cfg.eval_global_batch_size)
    return min(num_batches, cfg.eval_max_batches or num_batches)


def make_eval_batches(cfg: DataConfig, split: str = "validation", *,
                      process_index: int | None = None,
                      process_count: int | None = None) -> grain.MapDataset:
    """A MapDataset: eval batch index -> host-local batch (same format as training)."""
    p, pc = resolve_processes(process_index, process_count)
    gb = cfg.eval_global_batch_size
    rows = host_rows(gb, pc, "eval_batch_size")
    stream = EvalStream(cfg, split)
    T = cfg.seq_len
    num_rows = -(-(len(stream.tokens) - 1) // T)
    num_batches = -(-num_rows // gb)
    if cfg.eval_max_batches is not None:
        num_batches = min(num_batches, cfg.eval_max_batches)

    def batch(i: int) -> dict[str, Any]:
        tok = np.zeros((rows, T + 1), np.int64)
        pid = np.full((rows, T + 1), -1, np.int64)
        for j in range(rows):
            r = i * gb + p * rows + j
            chunk = stream.tokens[r * T: r * T + T + 1]
            tok[j, :len(chunk)] = chunk
            pid[j, :len(chunk)] = stream.piece_ids[r * T: r * T + T + 1]
        t, seg, pos = packing_lib.rows_from_flat(tok.ravel(), pid.ravel(), rows, T + 1)
        seg = np.where(pid >= 0, seg, 0).astype(np.int32)
        pos = np.where(pid >= 0, pos, 0).astype(np.int32)
        return packing_lib.to_batch(t, seg, pos, stream.eos_id)

    return grain.MapDataset.range(num_batches).map(batch)


def make_eval_iterator(cfg: DataConfig, split: str = "validation", *,
                       process_index: int | None = None, process_count: int | None = None):
    """Iterator over every eval batch of ``split`` once, in order (no shuffle, padded)."""
    ds = make_eval_batches(cfg, split, process_index=process_index, process_count=process_count)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))
