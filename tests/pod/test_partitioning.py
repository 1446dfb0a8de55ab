"""Mesh construction, rule overrides and the sharding-table / per-device-bytes check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ode_lm import partitioning as pt


def test_resolve_fills_the_single_minus_one():
    assert pt.resolve_parallelism((1, -1, 2), 8, "ici") == (1, 4, 2)
    assert pt.resolve_parallelism((2, 2, 2), 8, "ici") == (2, 2, 2)
    assert pt.resolve_parallelism((-1, 1, 1), 1, "ici") == (1, 1, 1)


@pytest.mark.parametrize(
    "dims, match",
    [((3, -1, 1), "does not divide the device count 8"),
     ((2, 2, 1), "uses 4 devices but 8 are available"),
     ((-1, -1, 1), "at most one -1"),
     ((1, 1), "expected 3 entries")],
)
def test_resolve_rejects_bad_shapes(dims, match):
    with pytest.raises(ValueError, match=match):
        pt.resolve_parallelism(dims, 8, "ici_parallelism")


def test_create_mesh_auto_axes_and_device_subsets():
    mesh = pt.create_mesh((2, -1, 2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    small = pt.create_mesh((1, -1, 1), devices=jax.devices()[:4])
    assert dict(small.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
    assert pt.batch_shards(mesh, pt.LOGICAL_AXIS_RULES) == 4
    assert pt.batch_sharding(mesh, pt.LOGICAL_AXIS_RULES).spec == P(("data", "fsdp"), None)
    data_only = pt.axis_rules((("activation_batch", "data"),))
    assert pt.batch_shards(mesh, data_only) == 2


def test_axis_rules_overrides_replace_entries_of_the_one_table():
    rules = dict(pt.axis_rules((("embed", None), ("activation_batch", ["data"]))))
    assert rules["embed"] is None
    assert rules["activation_batch"] == ("data",)
    assert rules["mlp"] == dict(pt.LOGICAL_AXIS_RULES)["mlp"]
    with pytest.raises(ValueError, match="unknown logical axis 'embedd'"):
        pt.axis_rules((("embedd", "fsdp"),))
    with pytest.raises(ValueError, match="names no mesh axis"):
        pt.axis_rules((("embed", "model"),))


def test_sharding_table_and_forgotten_annotation_check():
    mesh = pt.create_mesh((1, 4, 2))
    sharded = jax.ShapeDtypeStruct((64, 32), jnp.float32,
                                   sharding=NamedSharding(mesh, P("fsdp", "tensor")))
    # Replicated by the rules (names mapped to no mesh axis), however large a share it is.
    by_design = jax.ShapeDtypeStruct((640, 32), jnp.float32,
                                     sharding=NamedSharding(mesh, P(None, None)))
    forgotten = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    table, per_device, total = pt.sharding_table({"w": sharded})
    assert "P('fsdp', 'tensor')" in table and per_device == 64 * 32 * 4 // 8
    pt.check_param_annotations({"w": sharded, "norm": by_design})
    _, per_device, total = pt.sharding_table({"w": sharded, "v": forgotten})
    assert per_device == 64 * 32 * 4 // 8 + 64 * 32 * 4 and total == 2 * 64 * 32 * 4
    with pytest.raises(ValueError, match=r"parameter 'v' \(64, 32\) .*missing a logical-axis"):
        pt.check_param_annotations({"w": sharded, "v": forgotten})
    assert pt.bytes_per_device(np.zeros((3, 5), np.float32)) == 60


def test_batch_divisibility_uses_the_runs_rule_overrides(tmp_path):
    """MeshConfig.rule_overrides reach trainer.validate: activation_batch -> 'data' splits the
    batch 2 ways on a (2, 4, 1) mesh, so 6 rows are fine there and not under the default."""
    from types import SimpleNamespace

    from ode_lm.models.config import ModelConfig
    from ode_lm.training import trainer as trainer_lib
    from ode_lm.training.step import StepConfig

    mesh = pt.create_mesh((2, 4, 1))
    data = SimpleNamespace(global_batch_size=6, seq_len=16)
    model = ModelConfig(vocab_size=64, d_model=16, num_heads=2, max_seq_len=16)
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible by the 8 batch"):
        trainer_lib.validate(model, data, StepConfig(), mesh, pt.LOGICAL_AXIS_RULES)
    override = pt.axis_rules((("activation_batch", "data"),))
    trainer_lib.validate(model, data, StepConfig(), mesh, override)
    # and the Trainer passes its own (overridden) rules to that check
    mesh_cfg = trainer_lib.MeshConfig(ici_parallelism=(2, 4, 1),
                                      rule_overrides=(("activation_batch", "data"),))
    trainer = trainer_lib.Trainer(
        model_config=model, data_config=data, mesh_config=mesh_cfg,
        train_config=trainer_lib.TrainConfig(model_dir=str(tmp_path / "run"), num_train_steps=1),
        train_data=lambda *a: (None, iter(())))
    assert pt.batch_shards(trainer.mesh, trainer.rules) == 2
    with pytest.raises(ValueError, match="not divisible by the 8 batch shards"):
        trainer_lib.Trainer(
            model_config=model, data_config=data,
            mesh_config=trainer_lib.MeshConfig(ici_parallelism=(2, 4, 1)),
            train_config=trainer_lib.TrainConfig(model_dir=str(tmp_path / "r2"),
                                                 num_train_steps=1),
            train_data=lambda *a: (None, iter(())))
