"""ode-lm parallel-block weights → Hugging Face tensor dicts and config.json contents.

Input is a materialised / parallel-block model (``ParallelLM``): block weights stacked over
L layers (names and layouts in ``models/vector_field.py``), the step size already folded into
the output projections. torch ``nn.Linear`` stores [out, in], ode-lm kernels are [in, out].

* neox → ``GPTNeoXForCausalLM`` (no custom code). Its fused ``query_key_value`` rows are
  interleaved per head: row h·3·Dh + s·Dh + d is (head h, q/k/v s, channel d), whereas
  ode-lm's kernel is [E, 3, H, Dh]; hence the (H, 3, Dh) transpose.
* gpt2 / llama → the parallel-block model in ``hf_templates/modeling_ode_lm.py``
  (``trust_remote_code=True``), whose fused ``qkv`` rows are (q/k/v, head, channel).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ode_lm.models.common import rotary_dim
from ode_lm.models.config import ModelConfig


def to_numpy(x) -> np.ndarray:
    """A (possibly sharded) jax array as host float32."""
    return np.asarray(jax.device_get(x), np.float32)


def linear_weight(kernel: np.ndarray, n_in: int) -> np.ndarray:
    """[*in, *out] kernel → torch [out, in] weight."""
    in_size = int(np.prod(kernel.shape[:n_in]))
    return np.ascontiguousarray(kernel.reshape(in_size, -1).T)


def block_arrays(model) -> dict[str, np.ndarray]:
    """A discrete model's stacked block weights, name → host float32 [L, ...]."""
    return {k: to_numpy(v) for k, v in model.blocks.stacked().items()}


def neox_tensors(model) -> dict[str, np.ndarray]:
    cfg: ModelConfig = model.config
    w = block_arrays(model)
    e = cfg.d_model
    t: dict[str, np.ndarray] = {"gpt_neox.embed_in.weight": to_numpy(model.embeddings.token[...])}
    for i in range(cfg.num_layers):
        p = f"gpt_neox.layers.{i}."
        t[p + "input_layernorm.weight"] = w["norm1_scale"][i]
        t[p + "input_layernorm.bias"] = w["norm1_bias"][i]
        t[p + "post_attention_layernorm.weight"] = w["norm2_scale"][i]
        t[p + "post_attention_layernorm.bias"] = w["norm2_bias"][i]
        qkv = w["qkv_kernel"][i].transpose(2, 1, 3, 0)  # [E,3,H,Dh] → [H,3,Dh,E]
        t[p + "attention.query_key_value.weight"] = qkv.reshape(3 * e, e)
        t[p + "attention.query_key_value.bias"] = w["qkv_bias"][i].transpose(1, 0, 2).reshape(-1)
        t[p + "attention.dense.weight"] = linear_weight(w["out_kernel"][i], 2)
        t[p + "attention.dense.bias"] = w["out_bias"][i]
        t[p + "mlp.dense_h_to_4h.weight"] = linear_weight(w["mlp_in_kernel"][i], 1)
        t[p + "mlp.dense_h_to_4h.bias"] = w["mlp_in_bias"][i]
        t[p + "mlp.dense_4h_to_h.weight"] = linear_weight(w["mlp_out_kernel"][i], 1)
        t[p + "mlp.dense_4h_to_h.bias"] = w["mlp_out_bias"][i]
    t["gpt_neox.final_layer_norm.weight"] = to_numpy(model.head.norm_scale[...])
    t["gpt_neox.final_layer_norm.bias"] = to_numpy(model.head.norm_bias[...])
    # 'embed_out' is the name every transformers version loads (v5 renames it to lm_head).
    t["embed_out.weight"] = np.ascontiguousarray(to_numpy(model.head.kernel[...]).T)
    return t


def _rotary_pct(cfg: ModelConfig) -> float:
    rot = rotary_dim(cfg)
    pct = rot / cfg.head_dim
    return pct if int(cfg.head_dim * pct) == rot else (rot + 0.5) / cfg.head_dim


def neox_config(cfg: ModelConfig, token_ids: dict[str, int]) -> dict[str, Any]:
    pct = _rotary_pct(cfg)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.hidden_dim,
        "hidden_act": "gelu",  # exact (erf) GELU, as the neox flavour
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.norm_eps,
        "use_parallel_residual": True,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "rotary_pct": pct,  # transformers 4.x names ...
        "rotary_emb_base": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": pct},  # ... and 5.x
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        **token_ids,
    }


def remote_tensors(model) -> dict[str, np.ndarray]:
    cfg: ModelConfig = model.config
    w = block_arrays(model)
    e = cfg.d_model
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": to_numpy(model.embeddings.token[...])}
    if model.embeddings.position is not None:
        t["model.embed_positions.weight"] = to_numpy(model.embeddings.position[...])
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for ours, theirs in (("norm1", "attn_norm"), ("norm2", "mlp_norm")):
            t[p + f"{theirs}.weight"] = w[f"{ours}_scale"][i]
            if f"{ours}_bias" in w:
                t[p + f"{theirs}.bias"] = w[f"{ours}_bias"][i]
        qkv = w["qkv_kernel"][i].transpose(1, 2, 3, 0)  # [E,3,H,Dh] → [3,H,Dh,E]
        t[p + "attn.qkv.weight"] = qkv.reshape(3 * e, e)
        t[p + "attn.out.weight"] = linear_weight(w["out_kernel"][i], 2)
        if "qkv_bias" in w:
            t[p + "attn.qkv.bias"] = w["qkv_bias"][i].reshape(-1)
            t[p + "attn.out.bias"] = w["out_bias"][i]
        ups = ({"mlp_gate": "gate", "mlp_up": "up"} if cfg.flavour == "llama"
               else {"mlp_in": "up"})
        for ours, theirs in {**ups, "mlp_out": "down"}.items():
            t[p + f"mlp.{theirs}.weight"] = linear_weight(w[f"{ours}_kernel"][i], 1)
            if f"{ours}_bias" in w:
                t[p + f"mlp.{theirs}.bias"] = w[f"{ours}_bias"][i]
    t["model.final_norm.weight"] = to_numpy(model.head.norm_scale[...])
    if model.head.norm_bias is not None:
        t["model.final_norm.bias"] = to_numpy(model.head.norm_bias[...])
    if model.head.kernel is not None:
        t["lm_head.weight"] = np.ascontiguousarray(to_numpy(model.head.kernel[...]).T)
    return t


def remote_config(cfg: ModelConfig, token_ids: dict[str, int],
                  source_steps: int) -> dict[str, Any]:
    llama = cfg.flavour == "llama"
    return {
        "architectures": ["OdeLMForCausalLM"],
        "model_type": "ode_lm_parallel",
        "auto_map": {
            "AutoConfig": "configuration_ode_lm.OdeLMConfig",
            "AutoModelForCausalLM": "modeling_ode_lm.OdeLMForCausalLM",
        },
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.hidden_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "norm_type": "rmsnorm" if llama else "layernorm",
        "norm_eps": cfg.norm_eps,
        "norm_bias": not llama,
        "attention_bias": not llama,
        "mlp_bias": not llama,
        "mlp_act": "swiglu" if llama else "gelu_tanh",
        "position_type": "rope" if llama else "learned",
        "rope_theta": cfg.rope_theta,
        "rotary_fraction": rotary_dim(cfg) / cfg.head_dim if llama else 0.0,
        "tied_head": cfg.tied_embeddings,
        "tie_word_embeddings": False,
        "ode_flavour": cfg.flavour,
        "ode_solver_steps": source_steps,
        **token_ids,
    }
