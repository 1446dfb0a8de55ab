"""ModelConfig.attention_impl: 'auto' resolution, bad values, old configs, and the splash
kernel against the written-out XLA form (Pallas interpret mode on the CPU; a TPU lowering
with libtpu's compile-only devices)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import TINY, tiny_config

from ode_lm.models import ModelConfig, build_model
from ode_lm.models.common import attention_impl
from ode_lm.training.run_dir import RunDir

# The kernel tiles the sequence in 128-row blocks: T = 128 is the smallest length it takes.
LONG = dict(TINY, max_seq_len=128)
T = 128


def packed_batch():
    """Row 0: three documents (positions restart); row 1: one document."""
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, LONG["vocab_size"])
    lengths = (40, 60, 28)
    seg0 = np.repeat(np.arange(1, 4), lengths)
    pos0 = np.concatenate([np.arange(n) for n in lengths])
    segment_ids = jnp.asarray(np.stack([seg0, np.ones(T, int)]), jnp.int32)
    positions = jnp.asarray(np.stack([pos0, np.arange(T)]), jnp.int32)
    return tokens, positions, segment_ids


def test_auto_is_the_default_and_resolves_to_xla_on_cpu():
    cfg = tiny_config(LONG)
    assert cfg.attention_impl == "auto"
    assert jax.default_backend() == "cpu"
    assert attention_impl(cfg, T) == "xla"
    for impl in ("xla", "splash", "cudnn"):
        assert attention_impl(cfg.replace(attention_impl=impl), T) == impl


def test_unknown_attention_impl_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"ModelConfig.attention_impl='flash': expected one of"):
        ModelConfig(attention_impl="flash")


def test_old_model_config_json_without_the_field_loads(tmp_path):
    fields = dataclasses.asdict(tiny_config(LONG))
    del fields["attention_impl"]
    (tmp_path / "model_config.json").write_text(json.dumps(fields))
    assert RunDir(str(tmp_path)).model_config().attention_impl == "auto"


@pytest.mark.slow
def test_splash_matches_xla_on_a_packed_batch():
    """fp32: both forms compute the same softmax over the same keys; the kernel's online
    softmax only reassociates the sums (observed differences ~1e-7 of logits ~0.4)."""
    cfg = tiny_config(LONG)
    model = build_model(cfg, nnx.Rngs(0))
    splash = nnx.merge(nnx.graphdef(build_model(cfg.replace(attention_impl="splash"),
                                                nnx.Rngs(0))), nnx.state(model))
    tokens, positions, segment_ids = packed_batch()
    ref = np.asarray(model(tokens, positions, segment_ids))
    out = np.asarray(splash(tokens, positions, segment_ids))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_splash_needs_a_length_in_whole_tiles():
    cfg = tiny_config(LONG, attention_impl="splash")
    model = build_model(cfg, nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"attention_impl='splash'.*multiple of 128"):
        model(jnp.zeros((1, 96), jnp.int32))


def _libtpu() -> bool:
    from ode_lm.bench.topology import libtpu_available

    try:
        return libtpu_available()
    except ImportError:
        return False


@pytest.mark.skipif(not _libtpu(), reason="libtpu not installed (pip install -e '.[tpu]'): "
                    "no compile-only TPU devices to lower the kernel for")
def test_auto_lowers_to_the_splash_kernel_for_tpu():
    """Under a mesh of compile-only v5e devices 'auto' resolves to splash, and the attention
    (forward + backward) compiles to Mosaic custom calls with no [T, T] array in the program."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ode_lm import partitioning
    from ode_lm.bench.topology import parse_topology, topology_devices
    from ode_lm.models.common import attention, attention_mask

    devices = np.array(topology_devices(parse_topology("v5e:2x2"))).reshape(1, 4, 1)
    mesh = Mesh(devices, ("data", "fsdp", "tensor"))
    b, t, n, h = 4, 2 * T, 2, 64  # 2 tiles: the kernel's [., t, 128] logsumexp is not [t, t]
    qkv = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32,
                               sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32,
                               sharding=NamedSharding(mesh, PartitionSpec("fsdp")))

    def compiled_text(impl: str) -> str:
        def loss(q, k, v, s):
            mask = attention_mask(s) if impl == "xla" else None
            return attention(q, k, v, mask, impl=impl, segment_ids=s).sum()

        grad = jax.jit(jax.grad(loss, (0, 1, 2)))
        return grad.lower(qkv, qkv, qkv, seg).compile().as_text()

    with jax.set_mesh(mesh), nnx.logical_axis_rules(partitioning.axis_rules(())):
        assert attention_impl(ModelConfig(), t) == "splash"
        splash, xla = compiled_text("splash"), compiled_text("xla")
    assert "tpu_custom_call" in splash and "tpu_custom_call" not in xla
    assert f"{t},{t}]" not in splash and f"{t},{t}]" in xla  # the T x T logits
