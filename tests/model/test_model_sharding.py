"""The model builds and runs on an 8-device ('data','fsdp','tensor') = (2,2,2) mesh with the
logical-axis rules, and gives the same logits as on a bare CPU."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from model_helpers import tiny_config

from ode_lm.models import build_model
from ode_lm.partitioning import LOGICAL_AXIS_RULES, MESH_AXES


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_sharded_logits_equal_unsharded(flavour):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    cfg = tiny_config(flavour=flavour)
    x = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)
    plain = build_model(cfg, nnx.Rngs(0))
    expected = np.asarray(plain(x))
    mesh = jax.make_mesh((2, 2, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
        model = build_model(cfg, nnx.Rngs(0))
        a = model.block.layers["qkv"].a[...]
        assert isinstance(a.sharding, NamedSharding)
        assert a.sharding.spec == PartitionSpec(None, "fsdp", None, "tensor", None)
        assert model.embeddings.token[...].sharding.spec == PartitionSpec("tensor", "fsdp")
        logits = nnx.jit(lambda m, t: m(t))(model, x)
        w = nnx.jit(lambda m: m.weights_at(0.5))(model)
    assert w["mlp_out_kernel"].sharding.spec == PartitionSpec("tensor", "fsdp")
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5)
