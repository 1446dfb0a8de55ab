"""The run directory (``MODEL_DIR``): its layout and the files that hold a run's facts.

``RunDir`` builds every path in a run directory; no other module spells a file name of it
(the checkpointer, the run lock, the metrics writer and the trainer ask ``RunDir``). Loading a
saved run's model is ``training/saved_run.py``.

Layout (one run, pretraining or fine-tuning)::

    config.gin             the operative gin config of the run's first start, for people
                           (nothing reads it back, except the fallback for old runs below)
    config.<step>.gin      the operative config of a resume at <step> that changed settings
    model_config.json      ModelConfig of the latest checkpoint: the model is rebuilt from
                           this, no gin
    data_config.json       DataConfig (data dir resolved): eval, sample, export, analysis
                           and fine-tuning learn the run's data from this
    inputs.json            what the checkpoints depend on beyond the settings: the prepared
                           data's tokenizer record (spec, sha256, vocab_size, eos_id), which
                           a resume must match
    finetune.json          fine-tunes: what they were made from (method, mode, LoRA spec)
    finetune_result.json   fine-tunes: trainable parameter counts and the final eval
    summary.json           the final eval of the last finished ``ode-lm train``, each setting
                           and the provenance (command, commit, date, machine): what the
                           docs' demo table is regenerated from (tools/doc_tables.py)
    checkpoints/<step>/{state,data}   written by training/checkpoint.py
    sharding.txt           the parameter sharding table (partitioning.sharding_text)
    run.lock               training/run_lock.py, while a run holds MODEL_DIR
    metrics.jsonl, events.out.tfevents.*   training/metrics.py

The record changes only with training that happened: the trainer writes ``model_config.json``,
``data_config.json``, ``sharding.txt`` and the start's config when this start's first
checkpoint is handed to orbax, and on a resume drops the metrics rows and events of steps after
the checkpoint it resumed from (``metrics.trim_after``), so metrics.jsonl and TensorBoard hold
one timeline. A start with nothing to train writes nothing.

Runs from before ``data_config.json`` existed still load: their data settings are read, once
and with a warning, from the literal ``DataConfig.*`` bindings of their ``config.gin``, by
the reader the gin layer hands in (``RunDir(path, legacy_bindings=...)``, built by
``gin_setup.run_dir``). That fallback is the only reader of ``config.gin``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from ode_lm.data.config import DataConfig
from ode_lm.models.config import ModelConfig

log = logging.getLogger("ode_lm.run_dir")

CONFIG_GIN = "config.gin"
MODEL_CONFIG = "model_config.json"
DATA_CONFIG = "data_config.json"
INPUTS = "inputs.json"
FINETUNE = "finetune.json"
FINETUNE_RESULT = "finetune_result.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
SHARDING = "sharding.txt"
LOCK = "run.lock"
EVENTS_PREFIX = "events.out.tfevents."

_warned_legacy: set[str] = set()  # run dirs whose config.gin fallback was reported


class ConfigRecord(Protocol):
    """The run's operative config, from the config layer (gin: ``gin_setup.GinRecord``):
    kept with the start's first checkpoint, shown in TensorBoard, compared on resume."""

    def text(self) -> str: ...

    def markdown(self, text: str) -> str: ...

    def changes(self, old: str, new: str, model_dir: str | None = None) -> list[str]: ...


@dataclasses.dataclass(frozen=True)
class FinetuneRecord:
    """What a fine-tune records, through the trainer (under its run lock): ``info``
    (``finetune.json``: what it was made from) with the run files, and ``counts``
    (trainable parameters) in ``finetune_result.json`` with the final eval."""

    info: dict[str, Any]
    counts: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RunDir:
    """Paths and files of one run directory (reading never writes; writing is atomic).
    ``legacy_bindings``: gin text → its literal ``DataConfig.*`` values, for runs from before
    ``data_config.json`` (None: such a run records no data)."""

    path: str
    legacy_bindings: Callable[[str], dict[str, Any]] | None = dataclasses.field(
        default=None, compare=False, repr=False)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoints(self) -> str:
        """``checkpoints/``: one ``<step>/`` directory per checkpoint (orbax's layout)."""
        return self.file(CHECKPOINTS)

    @property
    def lock(self) -> str:
        return self.file(LOCK)

    @property
    def metrics(self) -> str:
        return self.file(METRICS)

    def event_files(self) -> list[str]:
        """TensorBoard event files (``events.out.tfevents.*``), oldest name first."""
        if not os.path.isdir(self.path):
            return []
        return sorted(self.file(n) for n in os.listdir(self.path)
                      if n.startswith(EVENTS_PREFIX))

    def start_config(self, step: int) -> str:
        """Where a start at ``step`` keeps its operative config: ``config.gin`` for the
        first start (step 0), ``config.<step>.gin`` for a resume that changed settings."""
        return self.file(CONFIG_GIN if step == 0 else f"config.{step}.gin")

    def config_at(self, step: int) -> tuple[int, str] | None:
        """(start step, text) of the config the run was trained with at ``step`` (the newest
        start config at or before it); None when the run keeps none."""
        starts = {0: CONFIG_GIN} if os.path.exists(self.file(CONFIG_GIN)) else {}
        if os.path.isdir(self.path):
            for name in os.listdir(self.path):
                parts = name.split(".")
                if len(parts) == 3 and parts[0] == "config" and parts[2] == "gin" \
                        and parts[1].isdigit():
                    starts[int(parts[1])] = name
        before = [s for s in starts if s <= step]
        if not before:
            return None
        at = max(before)
        with open(self.file(starts[at])) as f:
            return at, f.read()

    def has_checkpoint(self) -> bool:
        """A step directory under ``checkpoints/`` (complete or not: read without orbax)."""
        return os.path.isdir(self.checkpoints) and any(
            n.isdigit() for n in os.listdir(self.checkpoints))

    def checkpoint_steps(self) -> list[int]:
        """Complete checkpoint steps, oldest first ([] when there are none)."""
        import orbax.checkpoint as ocp

        if not os.path.isdir(self.checkpoints):
            return []
        return sorted(ocp.utils.checkpoint_steps(self.checkpoints))

    # ------------------------------------------------------------------ writing
    def write_run_files(self, model_config: ModelConfig, data_config: Any,
                        start_config: tuple[int, str] | None = None,
                        sharding: str | None = None,
                        finetune: dict[str, Any] | None = None,
                        inputs: dict[str, Any] | None = None) -> None:
        """What the trainer records with a start's first checkpoint (process 0, holding the
        run lock): the model and data the checkpoint was trained with, ``(step, text)`` of
        the start's operative config when it is to be kept (a first start, or changed
        settings), the parameter sharding table (``partitioning.sharding_text``), for a
        fine-tune what it was made from (``finetune.json``), and the inputs the checkpoint
        depends on (``inputs.json``: the tokenizer record)."""
        self.write_model_config(model_config)
        if inputs is not None:
            _write_json(self.file(INPUTS), inputs)
        if finetune is not None:
            _write_json(self.file(FINETUNE), finetune)
        if dataclasses.is_dataclass(data_config):
            self.write_data_config(data_config)
        if start_config is not None:
            _write_text(self.start_config(start_config[0]), start_config[1])
        if sharding is not None:
            _write_text(self.file(SHARDING), sharding)

    def write_model_config(self, config: ModelConfig) -> None:
        _write_json(self.file(MODEL_CONFIG), dataclasses.asdict(config))

    def write_data_config(self, config: Any) -> None:
        _write_json(self.file(DATA_CONFIG), dataclasses.asdict(config))

    def write_finetune_result(self, result: dict[str, Any]) -> None:
        _write_json(self.file(FINETUNE_RESULT), result)

    def write_summary(self, summary: dict[str, Any]) -> None:
        _write_json(self.file(SUMMARY), summary)

    # ------------------------------------------------------------------ reading
    def model_config(self) -> ModelConfig:
        path = self.file(MODEL_CONFIG)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: is {self.path} a training run directory?")
        return ModelConfig(**_read_json(path))

    def data_config(self) -> DataConfig | None:
        """The run's ``DataConfig``; None when the run does not record one."""
        path = self.file(DATA_CONFIG)
        names = {f.name for f in dataclasses.fields(DataConfig)}
        if os.path.exists(path):
            values = _read_json(path)
            unknown = sorted(set(values) - names)
            if unknown:
                raise ValueError(f"{path}: unknown DataConfig field(s) {unknown}")
            return DataConfig(**values)
        values = self._legacy_data_values()
        if values is None:
            return None
        return DataConfig(**{k: v for k, v in values.items() if k in names})

    def data_dir(self) -> str | None:
        """The run's prepared-data dir (fine-tunes: their own data), or None."""
        config = self.data_config()
        return config.data_dir if config is not None else None

    def inputs(self) -> dict[str, Any] | None:
        """``inputs.json`` (``{"tokenizer": {spec, sha256, vocab_size, eos_id}}``); None for
        a run that records none (one from before it, or with its own data pipeline)."""
        path = self.file(INPUTS)
        return _read_json(path) if os.path.exists(path) else None

    def finetune(self) -> dict[str, Any] | None:
        """``finetune.json`` of a fine-tuning run; None for a pretraining run."""
        path = self.file(FINETUNE)
        return _read_json(path) if os.path.exists(path) else None

    def finetune_result(self) -> dict[str, Any] | None:
        """``finetune_result.json`` of a finished fine-tune; None before it finished."""
        path = self.file(FINETUNE_RESULT)
        return _read_json(path) if os.path.exists(path) else None

    def summary(self) -> dict[str, Any] | None:
        """``summary.json`` of a finished ``ode-lm train``; None before one finished."""
        path = self.file(SUMMARY)
        return _read_json(path) if os.path.exists(path) else None

    def _legacy_data_values(self) -> dict[str, Any] | None:
        """Literal ``DataConfig.*`` bindings of an old run's ``config.gin`` (macros followed)."""
        path = self.file(CONFIG_GIN)
        if self.legacy_bindings is None or not os.path.exists(path):
            return None
        with open(path) as f:
            values = self.legacy_bindings(f.read())
        if not values:
            return None
        if self.path not in _warned_legacy:
            _warned_legacy.add(self.path)
            log.warning("%s has no %s (a run from before it existed): its data settings are "
                        "read from %s", self.path, DATA_CONFIG, CONFIG_GIN)
        return values


def _write_json(path: str, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, sort_keys=True))


def _write_text(path: str, text: str) -> None:
    """Atomic: a reader sees the old file or the new one (the temporary name is per process,
    so hosts that write the same file never trip over each other)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
