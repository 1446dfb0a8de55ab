"""The DiffEqFormer vector field f(x, t) = Attn_t(Norm1_t(x)) + MLP_t(Norm2_t(x)).

A block is described by a flat dict of *static* weights (``BlockWeights``); the names, shapes
and logical axes per flavour come from ``weight_spec``. ``TemporalBlock.weights(t)`` generates
that dict for a depth t; ``parallel_residual`` / ``attention_branch`` / ``mlp_branch`` apply
it. The discrete baselines and the materialised model hold the same dict stacked over layers,
so every model runs exactly the same block code. ``VectorField`` is f(x, t) itself: W(t)
applied to one batch, the one definition every solve, generation and the analysis evaluate.

Weight layout (E = d_model, H = heads, Dh = head_dim, F = mlp width):
  norm1_scale, norm2_scale  [E]            norm1_bias, norm2_bias [E]   (gpt2, neox)
  qkv_kernel  [E, 3, H, Dh]                qkv_bias  [3, H, Dh]         (gpt2, neox)
  out_kernel  [H, Dh, E]                   out_bias  [E]                (gpt2, neox)
  mlp_in_kernel [E, F]                     mlp_in_bias [F]              (gpt2, neox)
  mlp_gate_kernel, mlp_up_kernel [E, F]                                 (llama: SwiGLU)
  mlp_out_kernel [F, E]                    mlp_out_bias [E]             (gpt2, neox)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models.common import (
    BATCH_LENGTH_EMBED,
    BATCH_LENGTH_HEADS_KV,
    BATCH_LENGTH_MLP,
    apply_norm,
    apply_rotary,
    attention,
    attention_impl,
    attention_mask,
    compute_dtype,
    constrain,
    rotary_dim,
    tag,
)
from ode_lm.models.config import ModelConfig
from ode_lm.models.temporal import TemporalDense, TemporalNorm
from ode_lm.models.time_embedding import time_features

BlockWeights = dict[str, jax.Array]

# Output projections of the two branches: the ones `materialize` scales by dt.
OUTPUT_PROJECTIONS = ("out_kernel", "out_bias", "mlp_out_kernel", "mlp_out_bias")


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """One (time-dependent) linear map: kernel in+out, optional bias over out."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_axes: tuple[str, ...]
    out_axes: tuple[str, ...]
    use_bias: bool
    output_projection: bool


def dense_specs(config: ModelConfig) -> dict[str, DenseSpec]:
    """The linear maps of one block, keyed by layer name (kernel name = name + '_kernel')."""
    e, h, dh, f = config.d_model, config.num_heads, config.head_dim, config.hidden_dim
    bias = config.flavour != "llama"
    specs = {
        "qkv": DenseSpec((e,), (3, h, dh), ("embed",), ("qkv", "heads", "kv"), bias, False),
        "out": DenseSpec((h, dh), (e,), ("heads", "kv"), ("embed",), bias, True),
    }
    if config.flavour == "llama":
        specs["mlp_gate"] = DenseSpec((e,), (f,), ("embed",), ("mlp",), False, False)
        specs["mlp_up"] = DenseSpec((e,), (f,), ("embed",), ("mlp",), False, False)
    else:
        specs["mlp_in"] = DenseSpec((e,), (f,), ("embed",), ("mlp",), True, False)
    specs["mlp_out"] = DenseSpec((f,), (e,), ("mlp",), ("embed",), bias, True)
    return specs


def weight_spec(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every entry of a block's weight dict: name -> (shape, logical axes)."""
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    norm_bias = config.flavour != "llama"
    for n in ("norm1", "norm2"):
        out[f"{n}_scale"] = ((config.d_model,), ("norm",))
        if norm_bias:
            out[f"{n}_bias"] = ((config.d_model,), ("norm",))
    for name, s in dense_specs(config).items():
        out[f"{name}_kernel"] = (s.in_shape + s.out_shape, s.in_axes + s.out_axes)
        if s.use_bias:
            out[f"{name}_bias"] = (s.out_shape, s.out_axes)
    return out


def kernel_std(config: ModelConfig, name: str, num_layers: int | None = None) -> float:
    """Baseline kernel init: N(0, init_std²); with ``num_layers`` the residual output
    projections are scaled by 1/sqrt(2L) as in GPT-2 (the ODE's dt plays that role)."""
    if num_layers and dense_specs(config)[name].output_projection:
        return config.init_std / (2 * num_layers) ** 0.5
    return config.init_std


# ---------------------------------------------------------------------------------------------
# Pure block functions.
# ---------------------------------------------------------------------------------------------


def _dense(x, w: BlockWeights, name: str, subscripts: str, cdt):
    y = jnp.einsum(subscripts, x.astype(cdt), w[f"{name}_kernel"].astype(cdt))
    b = w.get(f"{name}_bias")
    return y if b is None else y + b.astype(cdt)


class KVCache(NamedTuple):
    """Keys/values of one attention over rows [0, T_max) (generation); a call writes its
    T_new rows at ``index``. ``key_valid`` [B, T_max] is False for prompt padding."""

    k: jax.Array  # [B, T_max, H, Dh]
    v: jax.Array
    index: jax.Array | int
    key_valid: jax.Array

    def write(self, k: jax.Array, v: jax.Array) -> KVCache:
        start = (0, self.index, 0, 0)
        return self._replace(k=jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), start),
                             v=jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), start))

    def mask(self, t_new: int) -> jax.Array:
        """[B, 1, T_new, T_max]: causal over absolute rows, padding keys hidden (a query
        always sees itself, so a padded row's softmax stays finite)."""
        q_idx = self.index + jnp.arange(t_new)[:, None]
        k_idx = jnp.arange(self.k.shape[1])[None, :]
        visible = (k_idx <= q_idx)[None] & (self.key_valid[:, None, :] | (k_idx == q_idx)[None])
        return visible[:, None]


def attention_branch(config: ModelConfig, w: BlockWeights, h, positions, mask,
                     cache: KVCache | None = None,
                     segment_ids: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    """(Attn(h), cache): h [B, T, E] (normalised) → [B, T, E] in compute dtype.

    With a ``cache`` the new keys/values are written into it and the queries attend over all
    its rows (``mask`` is then ignored: the cache knows which rows are visible). The splash
    kernel (``ModelConfig.attention_impl``) needs the packed ``segment_ids`` and no cache;
    calls without them (generation, the analysis helpers) use the XLA form."""
    cdt = compute_dtype(config)
    qkv = _dense(h, w, "qkv", "bte,eshd->btshd", cdt)  # s = the fused q/k/v axis
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    rot = rotary_dim(config)
    q = apply_rotary(q, positions, rot, config.rope_theta)
    k = apply_rotary(k, positions, rot, config.rope_theta)
    if cache is not None:
        cache = cache.write(k, v)
        k, v, mask = cache.k, cache.v, cache.mask(h.shape[1])
    q = tag(constrain(q, BATCH_LENGTH_HEADS_KV), "q")
    k = tag(constrain(k, BATCH_LENGTH_HEADS_KV), "k")
    v = tag(constrain(v, BATCH_LENGTH_HEADS_KV), "v")
    impl = attention_impl(config, h.shape[1])
    if impl == "splash" and (cache is not None or segment_ids is None):
        impl = "xla"
    ctx = tag(attention(q, k, v, mask, impl=impl, segment_ids=segment_ids), "attn_context")
    return tag(_dense(ctx, w, "out", "bthd,hde->bte", cdt), "attn_out"), cache


def mlp_branch(config: ModelConfig, w: BlockWeights, h):
    """MLP(h): GELU (tanh for GPT-2, exact for NeoX) or SwiGLU (Llama)."""
    cdt = compute_dtype(config)
    if config.flavour == "llama":
        gate = tag(_dense(h, w, "mlp_gate", "bte,ef->btf", cdt), "mlp_gate")
        up = tag(_dense(h, w, "mlp_up", "bte,ef->btf", cdt), "mlp_pre")
        act = jax.nn.silu(gate) * up
    else:
        pre = tag(_dense(h, w, "mlp_in", "bte,ef->btf", cdt), "mlp_pre")
        act = jax.nn.gelu(pre, approximate=config.flavour == "gpt2")
    act = tag(constrain(act, BATCH_LENGTH_MLP), "mlp_act")
    return tag(_dense(act, w, "mlp_out", "btf,fe->bte", cdt), "mlp_out")


def block_norm(config: ModelConfig, w: BlockWeights, n: str, x):
    """Norm ``n`` (norm1 | norm2) of a block's weights on x, in the compute dtype and tagged
    for remat: the one pre-branch norm (the analysis Jacobians use it too)."""
    h = apply_norm(config, x, w[f"{n}_scale"], w.get(f"{n}_bias"))
    return tag(h.astype(compute_dtype(config)), f"{n}_out")


def _dropout(y, rate: float, key):
    if key is None or rate <= 0.0:
        return y
    keep = jax.random.bernoulli(key, 1.0 - rate, y.shape)
    return jnp.where(keep, y / (1.0 - rate), 0).astype(y.dtype)


def parallel_residual(config: ModelConfig, w: BlockWeights, x, positions, mask, dropout_key=None,
                      cache: KVCache | None = None, segment_ids: jax.Array | None = None):
    """f(x) = Attn(Norm1(x)) + MLP(Norm2(x)) in float32, [B, T, E] → [B, T, E].

    With a ``cache`` (generation) it returns ``(f(x), cache)`` with the new keys/values.
    ``segment_ids`` (packed documents) let attention use the splash kernel."""
    x = constrain(x, BATCH_LENGTH_EMBED)
    k1, k2 = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    a, new_cache = attention_branch(config, w, block_norm(config, w, "norm1", x), positions,
                                    mask, cache, segment_ids)
    a = _dropout(a, config.dropout_rate, k1)
    m = _dropout(mlp_branch(config, w, block_norm(config, w, "norm2", x)), config.dropout_rate,
                 k2)
    f = constrain(a.astype(jnp.float32) + m.astype(jnp.float32), BATCH_LENGTH_EMBED)
    return f if cache is None else (f, new_cache)


def sequential_residual(config: ModelConfig, w: BlockWeights, x, positions, mask,
                        dropout_key=None, segment_ids: jax.Array | None = None):
    """A pre-norm GPT-2/Llama block: x + Attn(Norm1(x)), then + MLP(Norm2(·))."""
    x = constrain(x, BATCH_LENGTH_EMBED)
    k1, k2 = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    a, _ = attention_branch(config, w, block_norm(config, w, "norm1", x), positions, mask,
                            segment_ids=segment_ids)
    x = x + _dropout(a, config.dropout_rate, k1).astype(jnp.float32)
    m = mlp_branch(config, w, block_norm(config, w, "norm2", x))
    return constrain(x + _dropout(m, config.dropout_rate, k2).astype(jnp.float32),
                     BATCH_LENGTH_EMBED)


# ---------------------------------------------------------------------------------------------
# The vector field f(x, t) of one batch.
# ---------------------------------------------------------------------------------------------


class VectorField:
    """f(x, t) = Attn_t(Norm1_t(x)) + MLP_t(Norm2_t(x)) for one batch of token sequences.

    Written once so that the fixed-grid solve, the adaptive solve, KV-cached generation and
    the analysis (``DiffEqFormer.vector_field``) cannot drift apart. W(t) comes from
    ``weights_at(t)`` (time embedding + hypernetworks) unless the caller passes the weights
    it already generated for t (the fixed grid's precomputed W(t_k), generation's stages).
    ``segment_ids`` (packed documents; default one segment) give the causal attention mask.
    """

    def __init__(self, config: ModelConfig, positions: jax.Array,
                 segment_ids: jax.Array | None = None,
                 weights_at: Callable[[jax.Array | float], BlockWeights] | None = None):
        self.config = config
        self.positions = positions
        self.segment_ids = (jnp.ones(positions.shape, jnp.int32) if segment_ids is None
                            else segment_ids)
        self.mask = attention_mask(self.segment_ids)  # once per solve, not per evaluation
        self.weights_at = weights_at

    def weights(self, t: jax.Array | float, weights: BlockWeights | None = None) -> BlockWeights:
        """W(t): ``weights`` when given, else generated at t."""
        if weights is not None:
            return weights
        if self.weights_at is None:
            raise ValueError("VectorField without weights_at: pass the weights for t")
        return self.weights_at(t)

    def __call__(self, x: jax.Array, t: jax.Array | float, *,
                 weights: BlockWeights | None = None,
                 dropout_key: jax.Array | None = None) -> jax.Array:
        """f(x, t), float32 [B, T, E]; ``dropout_key`` only in training."""
        return parallel_residual(self.config, self.weights(t, weights), x, self.positions,
                                 self.mask, dropout_key, segment_ids=self.segment_ids)

    def with_cache(self, x: jax.Array, t: jax.Array | float, cache: KVCache, *,
                   weights: BlockWeights | None = None) -> tuple[jax.Array, KVCache]:
        """(f(x, t), cache) for new tokens whose attention also sees the earlier tokens'
        keys/values in ``cache`` (generation); theirs are written into the returned cache."""
        return parallel_residual(self.config, self.weights(t, weights), x, self.positions,
                                 None, cache=cache)


# ---------------------------------------------------------------------------------------------
# The time-dependent block: generates BlockWeights for a depth t.
# ---------------------------------------------------------------------------------------------


class TemporalBlock(nnx.Module):
    """One hypernetwork per weight matrix and per norm (each with its own time MLP g)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        norm_bias = config.flavour != "llama"
        self.norm1 = TemporalNorm(config, use_bias=norm_bias, rngs=rngs)
        self.norm2 = TemporalNorm(config, use_bias=norm_bias, rngs=rngs)
        self.layers = nnx.Dict({
            name: TemporalDense(config, s.in_shape, s.out_shape, s.in_axes, s.out_axes,
                                use_bias=s.use_bias, std=kernel_std(config, name), rngs=rngs)
            for name, s in dense_specs(config).items()
        })

    def weights(self, t: jax.Array | float) -> BlockWeights:
        """The static block weights at depth t (float32, shapes per ``weight_spec``).

        ``t`` may also be a vector of K times: every entry then gets a leading K axis.
        """
        feats = time_features(self.config, t)
        w: BlockWeights = {}
        for n in ("norm1", "norm2"):
            scale, bias = getattr(self, n).generate(feats)
            w[f"{n}_scale"] = scale
            if bias is not None:
                w[f"{n}_bias"] = bias
        for name, layer in self.layers.items():
            kernel, bias = layer.generate(feats)
            w[f"{name}_kernel"] = kernel
            if bias is not None:
                w[f"{name}_bias"] = bias
        return w
