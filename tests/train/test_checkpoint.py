"""Checkpoints: topology change 8 -> 4 -> 1 devices, half-written saves ignored, shape
mismatch errors, params-only restore (``saved_run.load_model``) from a run saved on 8 devices."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from model_helpers import tiny_config

from ode_lm.data import DataConfig
from ode_lm.training import checkpoint as ckpt_lib
from ode_lm.training.optim import OptimizerConfig
from ode_lm.training.run_dir import RunDir
from ode_lm.training.saved_run import load_model
from ode_lm.training.trainer import MeshConfig, TrainConfig, Trainer

MODEL = tiny_config(vocab_size=384)


@pytest.fixture(scope="module")
def data_config(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("ckpt_data")
    return DataConfig(source="builtin", tokenizer="bytes", data_dir=str(root / "data"),
                      holdout_fraction=0.05, seq_len=32, global_batch_size=8,
                      eval_max_batches=1)


def make_trainer(model_dir, data_config, steps: int, ici, num_devices: int, **kw) -> Trainer:
    return Trainer(
        model_config=kw.pop("model_config", MODEL),
        data_config=data_config,
        train_config=TrainConfig(model_dir=str(model_dir), num_train_steps=steps, log_every=1),
        optimizer_config=OptimizerConfig(learning_rate=3e-3, warmup_steps=1),
        checkpoint_config=ckpt_lib.CheckpointConfig(save_every=1, max_to_keep=2),
        mesh_config=MeshConfig(ici_parallelism=ici),
        devices=jax.devices()[:num_devices],
        print_fn=lambda _: None,
        **kw,
    )


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def run8(tmp_path_factory, data_config):
    """3 steps on a (2, 2, 2) mesh of 8 devices."""
    model_dir = tmp_path_factory.mktemp("topology") / "run"
    trainer = make_trainer(model_dir, data_config, 6, (2, 2, 2), 8)
    trainer.cfg = dataclasses.replace(trainer.cfg, num_train_steps=3)  # stop early, schedule of 6
    result = trainer.run()
    assert result.step == 3
    return model_dir, host(trainer.state)


@pytest.mark.slow
def test_topology_change_8_to_4_to_1(run8, data_config, tmp_path):
    model_dir, saved = tmp_path / "run", run8[1]
    shutil.copytree(run8[0], model_dir)  # keep the 8-device run at step 3 for other tests
    t4 = make_trainer(model_dir, data_config, 6, (1, -1, 2), 4)
    restored = t4.checkpointer.restore(3, t4.spec.abstract_state)
    assert ckpt_lib.tree_equal(host(restored), saved)
    assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(restored["params"]))
    result = t4.run()
    assert result.step == 6 and t4.checkpointer.all_steps()[-1] == 6
    t1 = make_trainer(model_dir, data_config, 8, (1, 1, 1), 1)
    result = t1.run()
    assert result.step == 8 and np.isfinite(result.eval["eval/loss"])
    steps = [json.loads(r)["step"] for r in (model_dir / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in r]
    assert steps == list(range(1, 9))


@pytest.mark.slow
def test_restore_model_on_one_cpu_from_8_device_run(run8):
    model_dir, saved = run8
    model, run = load_model(str(model_dir), step=3)
    assert run.config == MODEL and run.step == 3 and run.finetune is None
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert ckpt_lib.tree_equal(host(params), saved["params"])
    tokens = np.zeros((1, 8), np.int32)
    assert model(tokens).shape == (1, 8, MODEL.vocab_size)
    with pytest.raises(FileNotFoundError, match="checkpoint step 99"):
        load_model(str(model_dir), step=99)


def test_half_written_save_is_ignored(run8, tmp_path, data_config):
    model_dir = tmp_path / "copy"
    shutil.copytree(run8[0], model_dir)
    ckpt_dir = model_dir / "checkpoints"
    latest = max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    partial = ckpt_dir / f"{latest + 1}.orbax-checkpoint-tmp-1234567"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\x00" * 10)
    checkpointer = ckpt_lib.Checkpointer(str(model_dir))
    assert checkpointer.latest_step() == latest
    assert load_model(str(model_dir))[1].step == latest


def test_shape_mismatch_names_first_parameter_and_both_shapes(run8, data_config):
    model_dir, _ = run8
    wider = MODEL.replace(d_model=64)
    t = make_trainer(model_dir, data_config, 8, (1, 1, 1), 1, model_config=wider)
    with pytest.raises(ckpt_lib.ShapeMismatchError) as e:
        t.run()
    msg = str(e.value)
    assert "parameter 'block/" in msg or "parameter 'embeddings/" in msg
    assert "32" in msg and "64" in msg and "but the configured model wants" in msg


def test_restores_checkpoints_saved_with_zstd(tmp_path):
    """Runs saved before compression was turned off (orbax's StandardCheckpointHandler,
    zstd) restore through today's Checkpointer, onto another sharding."""
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    state = {"params": {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                                            NamedSharding(mesh, P("fsdp")))},
             "step": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
    directory = RunDir(str(tmp_path)).checkpoints
    with ocp.CheckpointManager(directory, item_handlers={
            "state": ocp.StandardCheckpointHandler()}) as old:
        old.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        old.wait_until_finished()
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), np.float32,
                                                   sharding=NamedSharding(mesh, P(None, "fsdp")))},
              "step": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P()))}
    ckpt = ckpt_lib.Checkpointer(str(tmp_path))
    restored = ckpt.restore(3, target)
    ckpt.close()
    np.testing.assert_array_equal(restored["params"]["w"], np.asarray(state["params"]["w"]))
    assert restored["params"]["w"].sharding.spec == P(None, "fsdp")
    assert int(restored["step"]) == 3


def test_saves_are_not_compressed(tmp_path):
    """A 4 MiB block of zeros stays 4 MiB on disk: compression costs CPU on every save
    and buys almost nothing on float32 training state."""
    zeros = {"params": {"w": jax.numpy.zeros((1024, 1024), np.float32)}}
    ckpt = ckpt_lib.Checkpointer(str(tmp_path))
    ckpt.save(1, zeros, force=True)
    ckpt.close()
    step_dir = pathlib.Path(RunDir(str(tmp_path)).checkpoints) / "1"
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) >= 4 * 2**20


@pytest.mark.parametrize("async_directories", [True, False])
def test_orbax_decides_saves_on_the_interval_only(tmp_path, async_directories):
    """should_save is orbax's decision: every save_every steps, never the first step of a
    fresh run (orbax's default InitialSavePolicy is left out), never a step already saved;
    the step directories may be made in orbax's background thread or on the caller's."""
    ckpt = ckpt_lib.Checkpointer(str(tmp_path), ckpt_lib.CheckpointConfig(save_every=3),
                                 async_directories=async_directories)
    assert [s for s in range(1, 10) if ckpt.should_save(s)] == [3, 6, 9]
    state = {"w": jax.numpy.arange(4.0)}
    assert not ckpt.save(1, state) and ckpt.save(3, state)
    ckpt.wait()
    assert not ckpt.should_save(3) and ckpt.should_save(6)
    assert not ckpt.reached_preemption(6)  # one process: no preemption service
    ckpt.close()
    assert ckpt_lib.Checkpointer(str(tmp_path)).all_steps() == [3]
