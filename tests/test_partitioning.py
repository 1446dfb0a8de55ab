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
    assert pt.batch_shards(mesh) == 4
    assert pt.batch_sharding(mesh).spec == P(("data", "fsdp"), None)


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
