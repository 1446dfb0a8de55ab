"""The trainer's data step: the default data prepared once on a pod (process 0 first, one
barrier) and checked against the model before any step, and the default train and eval
batches (``ode_lm.data``'s pipelines, as global arrays sharded over the batch)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ode_lm.models.config import ModelConfig
from ode_lm.training.run_lock import first_missing

# The input side, injectable so fine-tuning or tests can bring their own batches.
# train: (data_config, mesh, rules, start_step) -> (checkpointable iterator or None, batches)
TrainData = Callable[..., tuple[Any, Iterator[dict]]]
# eval: (data_config, mesh, rules) -> iterable of global batches (finite, loss-masked)
EvalData = Callable[..., Any]

def prepare_data_once(data_config: Any, sync: Callable[[str], None] | None = None) -> dict:
    """``ensure_prepared`` for a multi-host job: process 0 prepares the (shared) DATA_DIR
    while the others wait at a barrier, so hosts never race to write the same shards; a
    host that still finds no manifest afterwards (a per-host local DATA_DIR) prepares its
    own copy. Returns the manifest."""
    from ode_lm import data as data_lib

    if jax.process_count() > 1:
        if jax.process_index() == 0:
            data_lib.ensure_prepared(data_config)
        if sync is None:
            from jax.experimental import multihost_utils

            sync = multihost_utils.sync_global_devices
        sync("ode_lm: data prepared by process 0")
    return data_lib.ensure_prepared(data_config)


@contextlib.contextmanager
def data_dirs_kept_as_found(data_config: Any, model_dir: str) -> Iterator[None]:
    """For a command that prepares its data on its way (fine-tuning: before it can compare
    tokenizers): a local data dir it creates is removed again (process 0) when the command
    fails before ``model_dir`` holds a checkpoint, so the corrected command (the tokenizer
    the error names) is not refused by the data the failed one prepared. Ctrl-C keeps it:
    an interrupted preparation resumes."""
    from ode_lm.data.config import mixture_components
    from ode_lm.training.run_dir import RunDir

    dirs = [c.data_dir for _, c in mixture_components(data_config)] \
        if getattr(data_config, "mixture", None) else [data_config.data_dir]
    created = [top for top in map(_first_missing, dirs) if top is not None]
    try:
        yield
    except Exception:
        if created and jax.process_index() == 0 and not RunDir(model_dir).has_checkpoint():
            for top in created:
                shutil.rmtree(top, ignore_errors=True)
        raise


def _first_missing(path: str | None) -> str | None:
    """The topmost missing ancestor of a local ``path`` (None for a remote one)."""
    if not path or "://" in path:
        return None
    return first_missing(path)


def default_train_data(data_config: Any, mesh, rules, start_step: int):
    """The grain train pipeline of ode_lm.data over the prepared DATA_DIR (the trainer's data
    step has run ``prepare_data_once``), as global arrays sharded over the batch."""
    from ode_lm import data as data_lib

    iterator = data_lib.make_train_iterator(data_config, start_step=start_step)
    return iterator, (data_lib.to_global_batch(b, mesh, rules) for b in iterator)


def data_scalars(data_config: Any) -> Callable[[int], dict[str, float]]:
    """The data's figures after a step (a mixture: ``data/<component>/tokens``, cumulative,
    a pure function of the config and the step; else none)."""
    from ode_lm import data as data_lib

    return data_lib.TokenCount(data_config)


def default_eval_data(data_config: Any, mesh, rules):
    """Every validation batch once (padded, loss-masked), as global arrays."""
    from ode_lm import data as data_lib

    iterator = data_lib.make_eval_iterator(data_config)
    return (data_lib.to_global_batch(b, mesh, rules) for b in iterator)


def check_resume_tokenizer(run_dir: Any, data_config: Any, manifest: dict) -> None:
    """On a resume: the prepared data is tokenized as the checkpoints were trained, by the
    tokenizer record the run keeps (``RunDir.inputs``), else (a run from before it) by the
    manifest of the data dir it records; another tokenizer under the same spec (``bpe:N``
    trained on another corpus) is refused in one line, before anything is written."""
    from ode_lm.data.manifest import has_manifest, load_manifest

    new_dir = getattr(data_config, "data_dir", None)
    recorded = (run_dir.inputs() or {}).get("tokenizer")
    old_dir = run_dir.data_dir()
    if recorded is None:
        if not old_dir or not has_manifest(old_dir) or (
                new_dir and os.path.abspath(old_dir) == os.path.abspath(new_dir)):
            return
        recorded = load_manifest(old_dir)["tokenizer"]
    check_tokenizer_record(recorded, manifest, f"MODEL_DIR={run_dir.path}", old_dir,
                           f"DATA_DIR={new_dir}", "resume on the data it was trained on, or "
                           "train into a new MODEL_DIR")


def check_tokenizer_record(recorded: dict | None, manifest: dict, run: str,
                           trained_on: str | None, data: str, advice: str) -> None:
    """One line when ``manifest``'s tokenizer is not the ``recorded`` one (spec, sha256,
    vocab_size, eos_id: ``RunDir.inputs()["tokenizer"]``); nothing without a record."""
    now = manifest["tokenizer"]
    if recorded is None or all(recorded.get(k) == now.get(k)
                               for k in ("sha256", "vocab_size", "eos_id")):
        return
    where = f", {trained_on}" if trained_on else ""
    raise ValueError(
        f"tokenizer mismatch: {run} was trained on {recorded['spec']!r} (sha256 "
        f"{recorded['sha256'][:12]}{where}) but {data} holds {now['spec']!r} (sha256 "
        f"{now['sha256'][:12]}): {advice}")


def check_vocab_before_prepare(model_config: ModelConfig, data_config: Any) -> None:
    """Before a data dir is prepared (a BPE trained, a corpus tokenized: minutes), the
    vocabulary the tokenizer spec asks for (``bpe:<n>``: n) must fit the model's, refused
    at once as ``check_vocab`` would after; a prepared dir is ``check_vocab``'s."""
    from ode_lm.data import tokenizers as tok_lib
    from ode_lm.data.manifest import has_manifest

    if getattr(data_config, "mixture", None) or getattr(data_config, "streaming", False) \
            or has_manifest(data_config.data_dir):
        return
    spec = data_config.tokenizer
    size = (tok_lib.bpe_vocab_size(spec) if spec.startswith("bpe:")
            else tok_lib.get_tokenizer(spec).vocab_size)
    _check_size(model_config, data_config, size)


def _check_size(model_config: ModelConfig, data_config: Any, size: int) -> None:
    if size > model_config.vocab_size:
        raise ValueError(
            f"ModelConfig.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"{size} ({data_config.tokenizer} in {data_config.data_dir})")


def check_vocab(model_config: ModelConfig, data_config: Any, manifest: dict,
                evaluate: bool = True) -> int | None:
    """Before any step: the model's vocabulary covers the prepared data's token ids, and (with
    the default eval data) the validation split holds at least one eval batch (returned:
    their number), from the manifest alone (``prepare_data_once`` has checked the data dir
    itself)."""
    from ode_lm import data as data_lib

    _check_size(model_config, data_config, manifest["vocab_size"])
    if evaluate:  # the eval batches, for the eval's progress line
        return data_lib.check_eval_split(data_config, manifest)
    return None

