"""The training batches of a run: prepared shards, a mixture of them or, with
``DataConfig.streaming``, raw sources tokenized on the fly. One entry point above the
pipelines, so none imports another; a mixture's preparation and eval sets are its
components'."""

from __future__ import annotations

import itertools

import grain

from ode_lm.data import eval_sets
from ode_lm.data import manifest as prep
from ode_lm.data import mixture as mixture_lib
from ode_lm.data.config import DataConfig
from ode_lm.data.host_streams import host_rows
from ode_lm.data.pipeline import make_prepared_iterator, resolve_processes
from ode_lm.data.prepare import ensure_prepared as prepare_one
from ode_lm.data.streaming_source import make_streaming_iterator


def make_train_iterator(cfg: DataConfig, *, process_index: int | None = None,
                        process_count: int | None = None, start_step: int = 0,
                        split: str = "train") -> grain.DatasetIterator:
    """Host-local training batches of ``global_batch_size // process_count`` rows (prepared:
    this host's rows of a global batch that does not depend on the host count)."""
    p, pc = resolve_processes(process_index, process_count)
    host_rows(cfg.global_batch_size, pc)  # the batch must split over the hosts, either way
    if cfg.mixture:
        return mixture_lib.make_mixture_iterator(cfg, process_index=p, process_count=pc,
                                                 start_step=start_step, split=split)
    if cfg.streaming:
        return make_streaming_iterator(cfg, process_index=p, process_count=pc,
                                       start_step=start_step)
    return make_prepared_iterator(cfg, process_index=p, process_count=pc,
                                  start_step=start_step, split=split)


def ensure_prepared(cfg: DataConfig, **kwargs) -> dict:
    """``prepare.ensure_prepared``; a mixture: every component, checked to agree."""
    return mixture_lib.ensure_prepared(cfg) if cfg.mixture else prepare_one(cfg, **kwargs)


def eval_configs(cfg: DataConfig) -> list[tuple[str, DataConfig]]:
    """The named eval sets of a run: a mixture's components, else ``[("", cfg)]``."""
    return mixture_lib.components(cfg) if cfg.mixture else [("", cfg)]


def make_eval_iterator(cfg: DataConfig, split: str = "validation", **kwargs):
    """Every eval batch once; a mixture: its components' in turn (the overall figure). Each
    set is opened (and checked) here, not at the first batch."""
    its = [eval_sets.make_eval_iterator(c, split, **kwargs) for _, c in eval_configs(cfg)]
    return its[0] if len(its) == 1 else itertools.chain.from_iterable(its)


def check_eval_split(cfg: DataConfig, manifest: dict, split: str = "validation", **kwargs) -> int:
    """``eval_sets.check_eval_split`` over every eval set; the total number of batches."""
    if not cfg.mixture:
        return eval_sets.check_eval_split(cfg, manifest, split, **kwargs)
    return sum(eval_sets.check_eval_split(c, prep.load_manifest(c.data_dir), split, **kwargs)
               for _, c in eval_configs(cfg))
