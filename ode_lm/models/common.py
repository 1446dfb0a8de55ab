"""Building blocks shared by every model: parameters with logical axes, sharding constraints,
norms, rotary embeddings, attention (XLA / cuDNN / splash) and the remat policies.

Everything here is a pure function of arrays (no module state), so the ODE vector field, the
discrete baselines and the materialised model all run the very same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd
from flax.linen import spmd as linen_spmd
from jax.ad_checkpoint import checkpoint_name

from ode_lm.models import splash
from ode_lm.models.config import REMAT, ModelConfig

BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")
BATCH_LENGTH_HEADS_KV = (
    "activation_batch", "activation_length", "activation_heads", "activation_kv"
)
BATCH_LENGTH_MLP = ("activation_batch", "activation_length", "activation_mlp")
BATCH_LENGTH_VOCAB = ("activation_batch", "activation_length", "activation_vocab")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(config: ModelConfig) -> jnp.dtype:
    """The dtype of matmuls and branch activations (parameters are always float32)."""
    return _DTYPES[config.dtype]


def mesh_active() -> bool:
    """True inside ``jax.set_mesh(...)``: only then are shardings applied."""
    return not jax.sharding.get_abstract_mesh().empty


def normal_init(std: float | jax.Array) -> Callable:
    """N(0, std²) from ``jax.random.normal``, drawn flat and reshaped.

    With jax's default partitionable threefry the flat draw is bit-identical to
    ``nnx.initializers.normal(std)(key, shape)`` (tests/model/test_model_training.py checks
    it), but it
    compiles once per parameter *size*, and faster: threefry over a rank-4/5 shape compiled in
    3.8-8 s on a small shared CPU, over a vector of the same size in 1.2-1.3 s. Model
    construction dominates many tests' time; the suite's persistent compilation cache keeps
    these compiles (each is over its 0.5 s threshold).
    """

    def init(key, shape, dtype=jnp.float32):
        shape = tuple(int(d) for d in shape)
        z = jax.random.normal(key, (math.prod(shape),), dtype).reshape(shape)
        return z * jnp.asarray(std, dtype)

    return init


def make_param(
    key: jax.Array,
    init: Callable,
    shape: Sequence[int],
    names: Sequence[str | None],
    dtype=jnp.float32,
) -> nnx.Param:
    """A float32 ``nnx.Param`` annotated with logical axes (``out_sharding`` metadata).

    Same metadata as ``nnx.with_partitioning(init, names)``; it is placed eagerly on the mesh
    only when a mesh is set, so the model also builds on a plain CPU without any context.
    """
    if len(shape) != len(names):
        raise ValueError(f"make_param: shape {tuple(shape)} does not match axes {tuple(names)}")
    value = init(key, tuple(shape), dtype)
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=mesh_active())


def mesh_spec(shape: Sequence[int], names: Sequence[str | None]):
    """The PartitionSpec of logical ``names`` under the active rules and mesh (None outside
    them). Mesh axes that do not divide a dimension are dropped for that dimension, so tiny
    test shapes never fail where a production shape would shard."""
    rules = core_spmd.get_logical_axis_rules()
    if not rules or not mesh_active():
        return None
    mesh = jax.sharding.get_abstract_mesh()
    spec = linen_spmd.logical_to_mesh_axes(tuple(names), rules)
    fixed = []
    for dim, axes in zip(shape, spec, strict=True):
        if axes is None:
            fixed.append(None)
            continue
        group = (axes,) if isinstance(axes, str) else tuple(axes)
        size = 1
        for a in group:
            size *= mesh.shape[a]
        fixed.append(axes if dim % size == 0 else None)
    return jax.sharding.PartitionSpec(*fixed)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside a mesh/rules context."""
    spec = mesh_spec(x.shape, names)
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


# ---------------------------------------------------------------------------------------------
# Remat: generated weights are never saved across solver steps.
# ---------------------------------------------------------------------------------------------

# Activations named inside a block (see vector_field.py). Policies save a subset of them;
# unnamed values (generated weights W(t), norms' elementwise ops, attention probabilities)
# are recomputed in the backward pass.
DOT_NAMES = ("q", "k", "v", "attn_context", "attn_out", "mlp_pre", "mlp_gate", "mlp_out")
ALL_NAMES = DOT_NAMES + ("norm1_out", "norm2_out", "mlp_act")


def remat_policy(name: str) -> Callable:
    """Name → jax.checkpoint policy for one solver step / layer.

    ``none`` keeps every named activation, ``dots_saveable`` only matmul outputs, ``full`` only
    the residual stream. All three exclude the generated weights (jax's own
    ``save_anything_except_these_names`` saves everything, hence the allow-lists).
    """
    if name == "none":
        return jax.checkpoint_policies.save_only_these_names(*ALL_NAMES)
    if name == "dots_saveable":
        return jax.checkpoint_policies.save_only_these_names(*DOT_NAMES)
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    raise ValueError(f"ModelConfig.remat={name!r}: expected one of {REMAT}")


def tag(x: jax.Array, name: str) -> jax.Array:
    return checkpoint_name(x, name)


# ---------------------------------------------------------------------------------------------
# Norms, activations, rotary embeddings, attention.
# ---------------------------------------------------------------------------------------------


def layer_norm(x, scale, bias, eps: float):
    """LayerNorm with population variance, computed in float32."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y


def rms_norm(x, scale, eps: float):
    """RMSNorm (Llama), computed in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    return y * scale.astype(jnp.float32)


def apply_norm(config: ModelConfig, x, scale, bias=None):
    if config.flavour == "llama":
        return rms_norm(x, scale, config.norm_eps)
    return layer_norm(x, scale, bias, config.norm_eps)


def rotary_dim(config: ModelConfig) -> int:
    """Rotated part of each head: full for Llama, ``rotary_fraction`` for NeoX, none for GPT-2."""
    if config.flavour == "gpt2":
        return 0
    frac = 1.0 if config.flavour == "llama" else config.rotary_fraction
    rot = int(config.head_dim * frac)
    return rot - rot % 2


def apply_rotary(x, positions, rot: int, theta: float):
    """Rotate the first ``rot`` channels of each head (HF NeoX/Llama ``rotate_half`` layout).

    x: [B, T, H, Dh]; positions: [B, T] (restarting per packed document).
    """
    if rot == 0:
        return x
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rot/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xr = x[..., :rot].astype(jnp.float32)
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = (xr * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, x[..., rot:]], axis=-1) if rot < x.shape[-1] else out


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Boolean [B, 1, T, T]: causal and within the same packed segment."""
    t = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal[None])[:, None]


def platform() -> str:
    """The platform programs are being built for: the active mesh's devices (TPU for an AOT
    compile on a CPU host), else jax's default backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def attention_impl(config: ModelConfig, seq_len: int | None = None) -> str:
    """``ModelConfig.attention_impl`` resolved: ``'auto'`` → splash on TPU (when the length
    suits its 128-row tiles), cuDNN on GPU, the written-out XLA form elsewhere."""
    impl = config.attention_impl
    if impl != "auto":
        return impl
    kind = platform()
    if kind == "tpu" and (seq_len is None or seq_len % splash.BLOCK == 0):
        return "splash"
    return "cudnn" if kind == "gpu" else "xla"


def attention(q, k, v, mask, *, impl: str = "xla", segment_ids=None):
    """softmax(q kᵀ / √h, masked) v for q, k, v [B, T, N, H] and a boolean mask [B, 1, T, S].

    ``impl`` (see ``attention_impl``): ``'splash'`` is the Pallas kernel, which takes the
    packed ``segment_ids`` [B, T] (causal self-attention; ``mask`` is unused);
    ``'cudnn'`` is ``jax.nn.dot_product_attention`` (cuDNN's fused kernel where it applies).
    ``'xla'`` writes the equation out: jax's generic path scales the [B, N, T, S] logits
    rather than q, builds a second full-size mask and vmaps over query groups, which made the
    CPU train step's attention (forward + backward) ≈ 20 % slower. Logits and softmax are
    float32 whatever the activation dtype.
    """
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=mask)
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    if impl == "splash":
        if segment_ids is None:
            raise ValueError("attention(impl='splash') needs the packed segment_ids")
        return splash.splash_attention(q, k, v, segment_ids,
                                       spec=mesh_spec(q.shape, BATCH_LENGTH_HEADS_KV),
                                       interpret=platform() != "tpu")
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->bnth", probs, v).transpose(0, 2, 1, 3)


def default_inputs(tokens, positions, segment_ids):
    """Fill in positions 0..T-1 and a single segment when the caller passes none."""
    if tokens.ndim != 2:
        raise ValueError(f"model input tokens: expected shape [B, T], got {tokens.shape}")
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), dtype=jnp.int32)
    if positions.shape != tokens.shape or segment_ids.shape != tokens.shape:
        raise ValueError(
            f"positions {positions.shape} / segment_ids {segment_ids.shape} must match tokens "
            f"{tokens.shape}"
        )
    return positions, segment_ids
