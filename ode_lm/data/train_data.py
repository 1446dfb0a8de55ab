"""The training batches of a run: prepared shards or, with ``DataConfig.streaming``, raw
sources tokenized on the fly. One entry point above both pipelines, so neither imports the
other."""

from __future__ import annotations

import grain

from ode_lm.data.config import DataConfig
from ode_lm.data.pipeline import host_rows, make_prepared_iterator, resolve_processes
from ode_lm.data.streaming import make_streaming_iterator


def make_train_iterator(cfg: DataConfig, *, process_index: int | None = None,
                        process_count: int | None = None, start_step: int = 0,
                        split: str = "train") -> grain.DatasetIterator:
    """Host-local training batches of ``global_batch_size // process_count`` rows (prepared:
    this host's rows of a global batch that does not depend on the host count)."""
    p, pc = resolve_processes(process_index, process_count)
    host_rows(cfg.global_batch_size, pc)  # the batch must split over the hosts, either way
    if cfg.streaming:
        return make_streaming_iterator(cfg, process_index=p, process_count=pc,
                                       start_step=start_step)
    return make_prepared_iterator(cfg, process_index=p, process_count=pc,
                                  start_step=start_step, split=split)
