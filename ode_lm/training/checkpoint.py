"""Orbax checkpoints: async saves every N steps, retention, resume onto the current mesh
(params only, for tools: ``saved_run.restore_params``; early stops: ``preemption.py``).

Layout: ``MODEL_DIR/checkpoints/<step>/{state,data}``: the train-state dict (state.py) and
the data iterator's state (restored by ``data.host_streams.restore``). Orbax writes each step
into a temporary directory and renames it when complete, so a save cut short by a kill is
never listed and never restored.

Faults: a complete step whose files were damaged later (truncated, zero bytes) is skipped
with a warning naming it and the previous one is restored (``restore_latest``,
``restore_params``); nothing is deleted, and the trainer only moves a damaged step aside
(``<step>.damaged``) when it is about to save that step again. A failed save (disk full, any
write error, also one that surfaces later from an async save) raises
:class:`CheckpointSaveError`: one line naming the step and its path; the previous
checkpoint stays the latest. A checkpoint directory that cannot be written (read-only,
immutable, a file in its place) is found on the loop before orbax is called, so the run
stops at once instead of orbax waiting minutes for its own directory-creation signal.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ode_lm.config_types import check_types, require_at_least
from ode_lm.data import host_streams as streams_lib
from ode_lm.training.checkpoint_noise import install_save_noise_filters
from ode_lm.training.optim import path_name
from ode_lm.training.run_dir import RunDir
from ode_lm.training.save_worker import (
    FrozenIteratorState,
    SaveWorker,
    SnapshotPool,
    use_coordination_barriers,
)

log = logging.getLogger("ode_lm.checkpoint")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 100  # steps between saves (1 = every step); the final step is always saved
    max_to_keep: int | None = 3
    keep_period: int | None = None  # steps divisible by this are kept forever
    async_save: bool = True
    # Make orbax's save call on a worker thread, from an on-device copy of the state, so the
    # train loop is not held by its per-array work (save_worker.py); False: on the loop.
    off_loop: bool = True

    def __post_init__(self):
        check_types(self)
        require_at_least(self, 1, "save_every", "max_to_keep", "keep_period")


class ShapeMismatchError(ValueError):
    """A checkpoint's parameters do not fit the configured model."""


class CheckpointDamagedError(RuntimeError):
    """No complete checkpoint can be read back (the ones there are damaged)."""


class NotFiniteError(ValueError):
    """A restored checkpoint holds NaN or Inf (bit rot: random bytes read back as floats)."""


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions, I/O error)."""


def _reason(e: BaseException) -> str:
    """An exception as a short one-line reason (tensorstore's messages run to pages); the
    end is kept too: that is where the OS error ("No space left on device") is."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 360 else f"{text[:200]} ... {text[-150:]}"


class Checkpointer:
    """Thin policy layer over ``ocp.CheckpointManager`` with items ('state', 'data')."""

    def __init__(self, run: str | RunDir, config: CheckpointConfig = CheckpointConfig(), *,
                 async_directories: bool = True):
        """``run``: the run directory (or its path); ``async_directories``: orbax creates each
        step's directories in its background thread, off the train loop
        (``tools/bench_checkpoint.py`` compares both)."""
        self.config = config
        self.directory = epath.Path((run if isinstance(run, RunDir) else RunDir(run)).checkpoints)
        options = ocp.CheckpointManagerOptions(
            # orbax decides when to save (``should_save``): every ``save_every`` steps and at
            # a pod's preemption sync point. Its default policy would also save the first
            # step of every fresh run (InitialSavePolicy), so the policy is spelled out.
            save_interval_steps=config.save_every,
            save_decision_policy=ocp.checkpoint_managers.AnySavePolicy([
                ocp.checkpoint_managers.FixedIntervalPolicy(config.save_every),
                ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
            ]),
            max_to_keep=config.max_to_keep,
            keep_period=config.keep_period,
            enable_async_checkpointing=config.async_save,
            async_options=ocp.AsyncOptions(
                create_directories_asynchronously=async_directories and config.async_save),
            create=False,  # made by the first save: building a Checkpointer writes nothing
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
        self._pending: int | None = None  # step of the async save that may still fail
        self._submitted = -1  # the last step handed to the save worker
        self._worker = None
        if config.off_loop and config.async_save:
            if jax.process_count() > 1:  # before any orbax barrier of this process
                use_coordination_barriers()
            self._worker = SaveWorker()
        self._snapshots = SnapshotPool()
        self._failed = False
        self._damaged: list[int] = []  # steps restore_latest skipped as damaged
        install_save_noise_filters()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_iterator: Any = None, force: bool = False) -> bool:
        """Save when ``step`` is on the interval (or ``force``); returns whether it saved.

        Called every step: it first surfaces an earlier async save's failure, so a full disk
        stops the run at the next step, not at the next save.
        """
        self.check_for_errors()
        if not force and not self.should_save(step):
            return False
        self._set_aside_damaged()
        if step in self.manager.all_steps():
            return False
        self._check_writable(step)
        if self._worker is None:
            self._save_now(step, state, data_iterator)
            return True
        if step <= self._submitted:
            return False  # handed over already; orbax may not list it yet
        data = (FrozenIteratorState(data_iterator)
                if streams_lib.checkpointable(data_iterator) else None)
        self._worker.join()  # the previous save call has returned: one save in hand at most
        self._raise_worker_error()
        state = self._snapshots.take(state)  # dispatched; the next step may donate the state
        self._worker.submit(step, lambda: self._save_now(step, state, data))
        self._submitted = step
        return True

    def _save_now(self, step: int, state: Any, data_iterator: Any) -> None:
        """orbax's save call (on the loop, or on the save worker's thread)."""
        items = {"state": ocp.args.PyTreeSave(state)}
        if streams_lib.checkpointable(data_iterator):
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self._wait_written()  # the previous save's error is that step's, not this one's
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._save_error(step, e) from e
        self._pending = step if self.config.async_save else None
        if self._worker is not None:
            self._snapshots.written(state)

    def _check_writable(self, step: int) -> None:
        """Make and remove a probe directory in the checkpoint directory: orbax creates a
        step's directory in its background thread and, when that fails, waits ~5 minutes
        for the signal that it was made before it says anything."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".ode_lm-write-probe-", dir=str(self.directory)))
        except OSError as e:
            reason = e.strerror or _reason(e)
            raise self._save_error(step, e, f"cannot write to {self.directory}: {reason}") from e

    def is_written(self, step: int) -> bool:
        """Whether ``step`` is complete on disk (never blocks): orbax lists a step only
        once its temporary directory is renamed into place, after the last byte."""
        try:
            return step in complete_steps(self.directory)
        except OSError:
            return False

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` writes: orbax's decision (``manager.should_save``: on the
        interval, or a pod's preemption sync point, and after the latest saved step)."""
        if self._damaged and step <= max(self._damaged):
            # orbax never saves at or below its latest step, and that is a damaged one this
            # run redoes (save() sets it aside first): decide on the policy's terms alone
            return step % self.config.save_every == 0 or self.reached_preemption(step)
        return self.manager.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        """A pod's preemption sync point is at ``step`` (orbax; always False on one host)."""
        return self.manager.reached_preemption(step)

    def check_for_errors(self) -> None:
        """Raise CheckpointSaveError if the last async save has failed (does not block)."""
        self._raise_worker_error()
        if self._pending is None:
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:
            raise self._save_error(self._pending, e) from e

    def _save_error(self, step: int, e: BaseException,
                    why: str | None = None) -> CheckpointSaveError:
        self._failed, self._pending = True, None
        try:
            done = [s for s in complete_steps(self.directory) if s != step]
        except OSError:  # the directory itself is what failed (a file in its place)
            done = []
        kept = (f"the latest complete checkpoint is still step {done[-1]}" if done
                else "no checkpoint was saved")
        return CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory / str(step)} failed: "
            f"{why or _reason(e)}; {kept}"
        )

    def _set_aside_damaged(self) -> None:
        """Move the steps restore_latest skipped to ``<step>.damaged`` (kept, never deleted)
        before this run saves over them; orbax lists only plain step numbers."""
        if not self._damaged:
            return
        for step in self._damaged:
            src = self.directory / str(step)
            dst, n = self.directory / f"{step}.damaged", 1
            while dst.exists():
                n += 1
                dst = self.directory / f"{step}.damaged{n}"
            if src.exists() and jax.process_index() == 0:
                src.rename(dst)
                log.warning("moved damaged checkpoint %s to %s", src, dst)
        self._damaged = []
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("ode_lm: damaged checkpoints moved")
        self.manager.reload()

    def check_compatible(self, step: int, abstract_state: Any) -> None:
        """Raise ShapeMismatchError naming the first parameter whose shape differs."""
        meta = self.manager.item_metadata(step)["state"]
        saved = flat_shapes(meta.get("params", {}) if hasattr(meta, "get") else meta["params"])
        wanted = flat_shapes(abstract_state["params"])
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
            item=abstract_state, restore_args=restore_args(abstract_state))}
        state = self.manager.restore(step, args=ocp.args.Composite(**items))["state"]
        check_finite(state)
        self.restore_data(step, data_iterator)
        return state

    def restore_latest(self, abstract_state: Any) -> tuple[int | None, Any]:
        """(step, state) of the newest checkpoint that reads back whole, or (None, None).

        A damaged step (truncated or empty file, unreadable metadata or data state) is skipped
        with a warning naming it; when every step is damaged this raises
        CheckpointDamagedError naming the step directory. Nothing is deleted.
        ShapeMismatchError (a different model) is raised as it is.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        for i, step in enumerate(steps):
            try:
                streams_lib.saved_states(self.directory / str(step) / "data")  # parses
                return step, self.restore(step, abstract_state)
            except (ShapeMismatchError, streams_lib.DataStateError):
                raise
            except Exception as e:
                report_damaged(self.directory, step, e, steps[i + 1:])
                self._damaged.append(step)
        return None, None

    def restore_data(self, step: int, data_iterator: Any) -> bool:
        """Restore ``data_iterator`` in place from ``step``'s data item (``streams.restore``:
        every host's file merged, so a data-stream state resumes on any host count)."""
        return streams_lib.restore(data_iterator, self.directory / str(step) / "data",
                                   jax.process_index(), jax.process_count())

    def _raise_worker_error(self) -> None:
        if self._worker is not None and self._worker.error is not None:
            step, e = self._worker.error
            self._worker.error = None
            raise e if isinstance(e, CheckpointSaveError) else self._save_error(step, e)

    def wait(self) -> None:
        """Block until every save handed over is written; CheckpointSaveError if one failed."""
        if self._worker is not None:
            self._worker.join()
            self._raise_worker_error()
        self._wait_written()

    def _wait_written(self) -> None:
        """Block until orbax has written the pending async save."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_error(self._pending or -1, e) from e
        self._pending = None

    def close(self) -> None:
        """Finish the pending save and release orbax's threads; after a reported save
        failure the (same) background error is not raised again."""
        try:
            if self._worker is not None:
                self._worker.join()
                self._raise_worker_error()  # a failure the loop has not been told of yet
            if not self._failed:
                self.wait()
        finally:
            try:
                if self._worker is not None:
                    self._worker.close()
                self.manager.close()
            except Exception:
                if not self._failed:
                    raise


def complete_steps(directory: epath.Path) -> list[int]:
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []


def report_damaged(directory: epath.Path, step: int, e: BaseException, rest: list[int]) -> None:
    """Warn, in one line, about a damaged step (the step used instead, the damaged one, the
    cause in a few words), or raise when no earlier one is left to fall back to."""
    step_dir = directory / str(step)
    if not rest:
        raise CheckpointDamagedError(
            f"checkpoint {step_dir} is damaged ({damage_cause(e)}) and no earlier complete "
            "checkpoint is left; nothing was deleted (restore it from a copy, or move "
            "the checkpoints away to start afresh)"
        ) from e
    log.warning("checkpoint step %d is damaged (%s): falling back to step %d", step,
                damage_cause(e), rest[0])


_CAUSES = (  # (words in the error chain, the cause in a few words); first match wins
    (("OUT_OF_RANGE", "byte range", "Unexpected end", "truncated", "EOF"),
     "a file is truncated"),
    (("Expecting value", "JSONDecodeError", "empty"), "a file is empty or not JSON"),
    (("NOT_FOUND", "No such file", "does not exist"), "a file is missing"),
    (("DATA_LOSS", "corrupt", "checksum", "Error decoding", "Failed to decode"),
     "a file is corrupt"),
)


def damage_cause(e: BaseException) -> str:
    """Why a checkpoint did not read back, in a few words (TensorStore's own message runs
    to ~460 characters); the file named when the error chain names one."""
    if isinstance(e, NotFiniteError):
        return str(e)
    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(f"{type(x).__name__}: {x}")
        x = x.__cause__ or x.__context__
    text = " ".join(chain)
    first = " ".join(str(chain[-1]).split())
    cause = next((c for words, c in _CAUSES if any(w in text for w in words)),
                 first if len(first) <= 80 else first[:77] + "...")
    name = re.search(r'(?:reading|file) "([^"]+)"', text)
    return f"{cause}: {name.group(1)}" if name and "/" not in name.group(1) else cause


def restore_args(abstract: Any) -> Any:
    """Restore every array onto the sharding, shape and dtype of its abstract leaf."""
    return jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
        abstract,
    )


@jax.jit
def _finite(leaves: list) -> list:
    return [jax.numpy.all(jax.numpy.isfinite(x)) for x in leaves]


def check_finite(tree: Any) -> None:
    """NotFiniteError naming the first floating-point array of ``tree`` (restored params or
    train state) that holds NaN or Inf: a trained checkpoint never does (the trainer skips
    non-finite updates), a bit-rotted one reads back so without any other error."""
    leaves = [(path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
              if np.issubdtype(x.dtype, np.inexact)]
    if not leaves:
        return
    ok = jax.device_get(_finite([x for _, x in leaves]))
    bad = [name for (name, _), good in zip(leaves, ok, strict=True) if not good]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise NotFiniteError(f"NaN or Inf in {bad[0]}{more}")


def flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape") and not isinstance(x, dict)
    )[0]
    return {path_name(p): tuple(x.shape) for p, x in leaves}


def tree_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two pytrees of arrays (for tests and tools)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )
