"""Checkpoint saves off the train loop: one thread that makes orbax's save call.

Orbax's async save still does part of its work on the caller's thread before it returns:
it waits for the previous save to be written, then walks the train state (per array: replica
slices, device-to-host copies started, tensorstore specs; ~100 ms for cpu_small's 138
arrays). ``Checkpointer`` with ``CheckpointConfig.off_loop`` (the default) hands that call to
this thread instead. The loop only dispatches an on-device copy of the state (the next step
donates the state's own buffers, which orbax would still be reading) and freezes the data
iterator's state; it waits only while the previous save call has not returned yet, so at
most one copy is in hand beside the one orbax is writing. In a multi-process job orbax's
process barriers move to the coordination service first (``use_coordination_barriers``).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

import grain
import jax
import jax.numpy as jnp


class SaveWorker:
    """Runs save calls one at a time, in order, on a daemon thread; remembers the first
    failure (``(step, exception)``) for the loop to raise, and skips every save after it."""

    def __init__(self, name: str = "ode_lm-checkpoint"):
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self.error: tuple[int, BaseException] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, step: int, fn: Callable[[], None]) -> None:
        """Queue ``fn``; blocks while a call is queued and not yet started."""
        self._jobs.put((step, fn))

    def join(self) -> None:
        """Block until every submitted call has returned."""
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                step, fn = job
                if self.error is None:
                    try:
                        fn()
                    except BaseException as e:  # raised on the loop by Checkpointer
                        self.error = (step, e)
            finally:
                self._jobs.task_done()


@jax.jit
def snapshot(tree: Any) -> Any:
    """A copy of every array in fresh buffers with the same shardings (one dispatch)."""
    return jax.tree.map(jnp.copy, tree)


@functools.partial(jax.jit, donate_argnums=0, keep_unused=True)
def snapshot_into(spare: Any, tree: Any) -> Any:
    """``snapshot(tree)`` written into the buffers of ``spare`` (a written snapshot of the
    same structure): on a CPU device fresh buffers cost a page fault per 4 KiB (cpu_small's
    215 MiB: 55 k faults, 185 CPU-ms against 33 CPU-ms into reused buffers)."""
    del spare
    return jax.tree.map(jnp.copy, tree)


class SnapshotPool:
    """On-device copies of the train state for the save worker; on CPU the buffers of a
    copy orbax has finished writing are reused for the next (on an accelerator a fresh HBM
    buffer is cheap, and a kept spare would hold a train state's worth of HBM)."""

    def __init__(self):
        self._spare: Any = None
        self._writing: Any = None  # the copy orbax's background write may still read

    def take(self, tree: Any) -> Any:
        spare, self._spare = self._spare, None
        if spare is not None and jax.tree.structure(spare) == jax.tree.structure(tree):
            return snapshot_into(spare, tree)
        return snapshot(tree)

    def written(self, tree: Any) -> None:
        """``tree``'s save call returned and the write before it is complete: that earlier
        copy is free (call on the worker, before the loop takes the next copy)."""
        done, self._writing = self._writing, tree
        if done is not None and _on_cpu(done):
            self._spare = done


def _on_cpu(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(d.platform == "cpu" for d in leaves[0].sharding.device_set)


def use_coordination_barriers() -> None:
    """Make orbax synchronise processes through the coordination service (its
    ``experimental_orbax_use_distributed_barrier`` flag) instead of ``sync_global_devices``,
    a device collective: issued from the save worker, a device collective would interleave
    with the train step's in a different order on each process and deadlock the job. Sets
    the one absl flag as if given on the command line (the program's own flags stay
    unparsed)."""
    from absl import flags

    from ode_lm import compat

    flag = flags.FLAGS[compat.orbax_distributed_barrier_flag()]
    flag.value, flag.present = True, max(flag.present, 1)


class FrozenIteratorState:
    """The data iterator's state at the step being saved, as grain's checkpoint handler reads
    it (``get_state()``), written byte for byte as the live iterator would have been."""

    def __init__(self, iterator: Any):
        state = iterator.get_state()
        if isinstance(iterator, grain.DatasetIterator):
            import json

            state = json.dumps(state, indent=4).encode()  # the handler's own formatting
        self._state = state

    def get_state(self) -> bytes:
        return self._state

    def set_state(self, state: Any) -> None:  # never restored into: a save-only view
        raise TypeError("FrozenIteratorState is for saving only")
