"""Checkpoint saves off the train loop (training/save_worker.py): the loop is not held by
orbax's save call, each checkpoint holds the state and data position of its own step even
though later steps donate the state's buffers, and CPU copies reuse written buffers."""

from __future__ import annotations

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ode_lm.training import checkpoint as ckpt_lib
from ode_lm.training import save_worker


@functools.partial(jax.jit, donate_argnums=0)
def _step(state):
    """A train step stand-in that donates its input, as the real one does."""
    return {"params": {"w": state["params"]["w"] + 1.0}, "step": state["step"] + 1}


class _Iterator:
    """A checkpointable data iterator (get_state / set_state) that counts batches."""

    def __init__(self):
        self.position = 0

    def get_state(self) -> bytes:
        return str(self.position).encode()

    def set_state(self, state: bytes) -> None:
        self.position = int(state)

    def start_prefetch(self) -> None:  # grain's restore calls it
        pass


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def test_every_checkpoint_holds_its_own_step_although_later_steps_donate(tmp_path):
    ckpt = ckpt_lib.Checkpointer(str(tmp_path), ckpt_lib.CheckpointConfig(
        save_every=1, max_to_keep=None))
    assert ckpt._worker is not None  # off_loop is the default
    state = {"params": {"w": jnp.zeros((1024,))}, "step": jnp.int32(0)}
    data = _Iterator()
    for step in range(1, 7):
        state = _step(state)
        data.position = 10 * step
        assert ckpt.save(step, state, data)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3, 4, 5, 6]
    for step in (1, 4, 6):
        restored = ckpt.restore(step, _abstract(state))
        assert int(restored["step"]) == step
        np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), float(step))
        again = _Iterator()
        assert ckpt.restore_data(step, again) and again.position == 10 * step
    ckpt.close()


def test_the_loop_is_not_held_by_a_slow_save_call(tmp_path, monkeypatch):
    """orbax's save call takes 1 s here; the loop's save() returns at once unless the
    previous call is still running (one save in hand)."""
    ckpt = ckpt_lib.Checkpointer(str(tmp_path), ckpt_lib.CheckpointConfig(save_every=1))
    state = {"params": {"w": jnp.zeros((16,))}, "step": jnp.int32(0)}
    state = _step(state)
    assert ckpt.save(1, state)  # compiles the copy
    ckpt.wait()
    original, threads = ckpt.manager.save, []

    def slow_save(*args, **kwargs):
        threads.append(threading.current_thread().name)
        time.sleep(1.0)
        return original(*args, **kwargs)

    monkeypatch.setattr(ckpt.manager, "save", slow_save)
    state = _step(state)
    t0 = time.perf_counter()
    assert ckpt.save(2, state)
    returned = time.perf_counter() - t0
    state = _step(state)  # the loop goes on while the worker saves step 2
    ckpt.wait()
    assert threads == ["ode_lm-checkpoint"]  # made on the worker, not on this thread
    assert returned < 0.5  # against the 1 s sleep, not a host's speed
    assert ckpt.all_steps() == [1, 2]
    assert int(ckpt.restore(2, _abstract(state))["step"]) == 2
    ckpt.close()


def test_on_loop_config_saves_on_the_callers_thread(tmp_path, monkeypatch):
    ckpt = ckpt_lib.Checkpointer(str(tmp_path), ckpt_lib.CheckpointConfig(
        save_every=1, off_loop=False))
    assert ckpt._worker is None
    original, threads = ckpt.manager.save, []

    def recording_save(*args, **kwargs):
        threads.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(ckpt.manager, "save", recording_save)
    assert ckpt.save(1, {"w": jnp.ones((4,))})
    ckpt.close()
    assert threads == [threading.current_thread()]


def test_snapshot_pool_reuses_written_buffers_on_cpu():
    pool = save_worker.SnapshotPool()
    tree = {"a": jnp.arange(8.0), "b": jnp.int32(3)}
    first = pool.take(tree)
    pool.written(first)  # its save call returned
    second = pool.take(tree)
    assert not first["a"].is_deleted()  # orbax may still write the first: not reused yet
    pool.written(second)  # the first one's write is complete now
    tree = {"a": jnp.arange(8.0) + 1, "b": jnp.int32(4)}
    third = pool.take(tree)
    assert first["a"].is_deleted()  # donated: its buffers now hold the third copy
    np.testing.assert_array_equal(np.asarray(third["a"]), np.arange(8.0) + 1)
    assert int(third["b"]) == 4


def test_a_worker_failure_is_raised_once_and_later_saves_are_skipped(tmp_path, monkeypatch):
    ckpt = ckpt_lib.Checkpointer(str(tmp_path), ckpt_lib.CheckpointConfig(save_every=1))

    def failing_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.manager, "save", failing_save)
    assert ckpt.save(1, {"w": jnp.ones((4,))})
    with pytest.raises(ckpt_lib.CheckpointSaveError, match="step 1 .* No space left"):
        ckpt.save(2, {"w": jnp.ones((4,))})
    ckpt.close()  # reported already: not raised again
    assert ckpt.all_steps() == []


def test_orbax_barriers_move_off_device_collectives(monkeypatch):
    """What a multi-process Checkpointer does before it saves off the loop (the 2-process
    jobs of test_multihost.py and test_host_faults.py run that path): orbax's process
    barriers go through the coordination service, not a device collective that would
    interleave with the train step's."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost

    flag = flags.FLAGS[multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name]
    monkeypatch.setattr(flag, "value", flag.value)  # restored after the test
    monkeypatch.setattr(flag, "present", flag.present)
    save_worker.use_coordination_barriers()
    assert multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.value is True
