"""Every private library API ode-lm relies on (``ode_lm/compat.py``), called once: a version
bump that moves one fails here, naming the call, before it fails a run."""

from __future__ import annotations

import os

import gin
import pytest

from ode_lm import compat


def test_jax_private_apis():
    import jax

    client = compat.coordination_client()
    assert client is None or hasattr(client, "wait_at_barrier")
    if not jax.distributed.is_initialized():
        assert client is None
    assert compat.running_in_cloud_tpu_vm() in (True, False)
    path = compat.tpu_library_path()
    assert path is None or isinstance(path, str)


def test_libtpu_is_told_its_accelerator_off_a_tpu_vm(monkeypatch):
    from jax._src import hardware_utils

    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "tpu-0,tpu-1")  # the user's own: kept
    compat.quiet_libtpu_off_tpu("v5e-4")
    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        assert "TPU_ACCELERATOR_TYPE" not in os.environ
    else:
        assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5e-4"
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "tpu-0,tpu-1"


def test_optax_masked_node_is_what_multi_transform_leaves_for_frozen_params():
    import jax
    import jax.numpy as jnp
    import optax

    masked = compat.masked_node_type()
    tx = optax.multi_transform({"train": optax.adam(0.1), "frozen": optax.set_to_zero()},
                               {"a": "train", "b": "frozen"})
    state = tx.init({"a": jnp.ones(2), "b": jnp.ones(2)})
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, masked))
    assert any(isinstance(x, masked) for x in leaves)


def test_orbax_distributed_barrier_flag_is_an_absl_flag():
    from absl import flags

    import ode_lm.training.save_worker  # noqa: F401  (orbax defines the flag on import)

    name = compat.orbax_distributed_barrier_flag()
    assert name in flags.FLAGS


def test_gin_private_config_table():
    gin.clear_config()
    try:
        gin.parse_config("STEPS = 4\nSEEN = %STEPS")
        assert compat.gin_macros() == {"STEPS": "4", "SEEN": "%STEPS"}
        assert compat.gin_macro_references() == {"STEPS"}
    finally:
        gin.clear_config()


def test_a_moved_api_fails_naming_the_call(monkeypatch):
    from jax._src import distributed as jax_distributed

    monkeypatch.delattr(jax_distributed, "global_state")
    with pytest.raises(compat.CompatError,
                       match=r"private API jax\._src\.distributed\.global_state\.client is gone"):
        compat.coordination_client()
