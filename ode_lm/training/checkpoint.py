"""Orbax checkpoints: async saves every N steps, retention, resume onto the current mesh,
params-only restore for tools, and SIGTERM/preemption handling.

Layout: ``MODEL_DIR/checkpoints/<step>/{state,data}``. ``state`` is the train-state dict
(see state.py); ``data`` is the grain iterator state. Orbax writes each step into a
temporary directory and renames it when complete, so a save cut short by a kill is never
listed and never restored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ode_lm.config_types import check_types
from ode_lm.training.optim import path_name

CHECKPOINT_SUBDIR = "checkpoints"
MODEL_CONFIG_FILE = "model_config.json"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 100  # steps between saves (1 = every step); the final step is always saved
    max_to_keep: int | None = 3
    keep_period: int | None = None  # steps divisible by this are kept forever
    async_save: bool = True

    def __post_init__(self):
        check_types(self)
        if self.save_every < 1:
            raise ValueError(f"CheckpointConfig.save_every={self.save_every}: must be >= 1")


class ShapeMismatchError(ValueError):
    """A checkpoint's parameters do not fit the configured model."""


def _is_grain_iterator(it: Any) -> bool:
    return isinstance(it, grain.DatasetIterator) or (
        hasattr(it, "get_state") and hasattr(it, "set_state")
    )


class Checkpointer:
    """Thin policy layer over ``ocp.CheckpointManager`` with items ('state', 'data')."""

    def __init__(self, model_dir: str, config: CheckpointConfig = CheckpointConfig()):
        self.config = config
        self.directory = epath.Path(model_dir) / CHECKPOINT_SUBDIR
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.max_to_keep,
            keep_period=config.keep_period,
            enable_async_checkpointing=config.async_save,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of a save cut short by a kill
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                # No zstd: a float32 train state barely compresses (cpu_small: 215 → 200 MiB)
                # while compressing doubled the CPU cost of every save (0.6 → 1.3 CPU-s),
                # which async saving cannot hide on a busy host.
                "state": ocp.PyTreeCheckpointHandler(use_compression=False),
                "data": grain.checkpoint.CheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_iterator: Any = None, force: bool = False) -> bool:
        """Save when ``step`` is on the interval (or ``force``); returns whether it saved."""
        if not force and step % self.config.save_every:
            return False
        if step in self.manager.all_steps():
            return False
        items = {"state": ocp.args.PyTreeSave(state)}
        if data_iterator is not None and _is_grain_iterator(data_iterator):
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        return True

    def check_compatible(self, step: int, abstract_state: Any) -> None:
        """Raise ShapeMismatchError naming the first parameter whose shape differs."""
        meta = self.manager.item_metadata(step)["state"]
        saved = _flat_shapes(meta.get("params", {}) if hasattr(meta, "get") else meta["params"])
        wanted = _flat_shapes(abstract_state["params"])
        for name, shape in wanted.items():
            if name not in saved:
                raise ShapeMismatchError(
                    f"checkpoint step {step} in {self.directory} has no parameter {name!r} "
                    f"(model wants shape {shape}); was it saved from a different model?"
                )
            if tuple(saved[name]) != tuple(shape):
                raise ShapeMismatchError(
                    f"checkpoint step {step} in {self.directory}: parameter {name!r} has shape "
                    f"{tuple(saved[name])} but the configured model wants {tuple(shape)}"
                )
        extra = sorted(set(saved) - set(wanted))
        if extra:
            raise ShapeMismatchError(
                f"checkpoint step {step} in {self.directory} has parameter {extra[0]!r} that "
                "the configured model lacks"
            )

    def restore(self, step: int, abstract_state: Any, data_iterator: Any = None) -> Any:
        """Restore the train state onto the shardings in ``abstract_state`` (any mesh).

        The data iterator is restored in place when its saved state exists for this process
        layout; otherwise it is left as given (the caller positions it from the step).
        """
        self.check_compatible(step, abstract_state)
        items = {"state": ocp.args.PyTreeRestore(
            item=abstract_state, restore_args=_restore_args(abstract_state))}
        has_data = data_iterator is not None and _is_grain_iterator(data_iterator)
        data_dir = self.directory / str(step) / "data"
        pidx, pcount = jax.process_index(), jax.process_count()
        if has_data and (data_dir / f"process_{pidx}-of-{pcount}.json").exists():
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"]

    def data_restored(self, step: int) -> bool:
        pidx, pcount = jax.process_index(), jax.process_count()
        return (self.directory / str(step) / "data" / f"process_{pidx}-of-{pcount}.json").exists()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _restore_args(abstract: Any) -> Any:
    """Restore every array onto the sharding, shape and dtype of its abstract leaf."""
    return jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
        abstract,
    )


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape") and not isinstance(x, dict)
    )[0]
    return {path_name(p): tuple(x.shape) for p, x in leaves}


# ------------------------------------------------------------------- params only


def restore_params(model_dir: str, abstract_params: Any, step: int | None = None) -> tuple:
    """(params, step): only the parameters of a run, onto ``abstract_params``' shardings.

    Works from a checkpoint saved on any mesh; the optimizer state is never read.
    """
    directory = epath.Path(model_dir) / CHECKPOINT_SUBDIR
    steps = sorted(ocp.utils.checkpoint_steps(directory)) if directory.exists() else []
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint under {directory}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"checkpoint step {step} not in {directory} (have {steps})")
    path = directory / str(step) / "state"
    restore_args = _restore_args(abstract_params)
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
        saved = _flat_shapes(tree["params"])
        for name, shape in _flat_shapes(abstract_params).items():
            if saved.get(name) != tuple(shape):
                raise ShapeMismatchError(
                    f"{path}: parameter {name!r} has shape {saved.get(name)} but the model "
                    f"wants {tuple(shape)}"
                )
        restored = ckptr.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item={"params": abstract_params},
                restore_args={"params": restore_args},
                partial_restore=True,
            ),
        )
    return restored["params"], step


def save_model_config(model_dir: str, config: Any) -> None:
    """``MODEL_DIR/model_config.json``: rebuild the model without parsing gin."""
    path = os.path.join(model_dir, MODEL_CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(dataclasses.asdict(config), f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


def load_model_config(model_dir: str):
    from ode_lm.models.config import ModelConfig

    path = os.path.join(model_dir, MODEL_CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {model_dir} a training run directory?")
    with open(path) as f:
        return ModelConfig(**json.load(f))


# -------------------------------------------------------------------- preemption


class PreemptionWatcher:
    """Turns SIGTERM (and JAX's preemption sync point on pods) into a 'stop after this step'."""

    def __init__(self):
        self._event = threading.Event()
        self._previous = None

    def install(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self._event.set()

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def should_stop(self, step: int) -> bool:
        if self._event.is_set():
            return True
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:  # preemption service not initialised
                return False
        return False


def tree_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two pytrees of arrays (for tests and tools)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )
