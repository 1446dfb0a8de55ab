"""Sequential baselines → stock transformers classes (no custom code, no ``auto_map``).

``SequentialLM`` runs pre-norm blocks x ← x + Attn(Norm1(x)); x ← x + MLP(Norm2(x)), which
is exactly GPT-2 (gpt2 flavour), Llama (llama) and GPT-NeoX with
``use_parallel_residual=False`` (neox). Layouts (ode-lm kernels are [in, out]):

* GPT-2 uses ``Conv1D`` weights stored [in, out]; its fused ``c_attn`` columns are
  (q/k/v, head, channel), i.e. ode-lm's ``qkv_kernel`` [E, 3, H, Dh] reshaped to [E, 3E]
  as it is. GELU is ``gelu_new`` (tanh), the head is tied to ``wte``, positions are learned.
* Llama uses ``nn.Linear`` [out, in] per projection. ode-lm's rotary is already the HF
  ``rotate_half`` layout (first half of each head's channels paired with the second half),
  so q/k need no permutation. RMSNorm eps = ``norm_eps``; untied ``lm_head``; no biases.
* NeoX reuses ``hf_weights.neox_tensors`` (same names); only the config differs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ode_lm.export.hf_weights import (
    block_arrays,
    linear_weight,
    neox_config,
    neox_tensors,
    to_numpy,
)
from ode_lm.models.common import rotary_dim
from ode_lm.models.config import ModelConfig


def check_sequential(cfg: ModelConfig) -> None:
    """Refuse what the stock class cannot express (before anything is written)."""
    if cfg.flavour == "llama" and rotary_dim(cfg) != cfg.head_dim:
        raise ValueError(
            f"--format=hf: the sequential llama baseline rotates {rotary_dim(cfg)} of "
            f"head_dim={cfg.head_dim} channels; LlamaForCausalLM rotates all of them "
            "(an even head_dim is needed); export it with --format=raw")


def gpt2_tensors(model) -> dict[str, np.ndarray]:
    cfg: ModelConfig = model.config
    w = block_arrays(model)
    e = cfg.d_model
    t = {"transformer.wte.weight": to_numpy(model.embeddings.token[...]),
         "transformer.wpe.weight": to_numpy(model.embeddings.position[...])}
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            t[p + f"{theirs}.weight"] = w[f"{ours}_scale"][i]
            t[p + f"{theirs}.bias"] = w[f"{ours}_bias"][i]
        t[p + "attn.c_attn.weight"] = w["qkv_kernel"][i].reshape(e, 3 * e)  # Conv1D [in, out]
        t[p + "attn.c_attn.bias"] = w["qkv_bias"][i].reshape(3 * e)
        t[p + "attn.c_proj.weight"] = w["out_kernel"][i].reshape(e, e)
        t[p + "attn.c_proj.bias"] = w["out_bias"][i]
        t[p + "mlp.c_fc.weight"] = w["mlp_in_kernel"][i]
        t[p + "mlp.c_fc.bias"] = w["mlp_in_bias"][i]
        t[p + "mlp.c_proj.weight"] = w["mlp_out_kernel"][i]
        t[p + "mlp.c_proj.bias"] = w["mlp_out_bias"][i]
    t["transformer.ln_f.weight"] = to_numpy(model.head.norm_scale[...])
    t["transformer.ln_f.bias"] = to_numpy(model.head.norm_bias[...])
    return {k: np.ascontiguousarray(v) for k, v in t.items()}  # lm_head is tied to wte


def llama_tensors(model) -> dict[str, np.ndarray]:
    cfg: ModelConfig = model.config
    w = block_arrays(model)
    t = {"model.embed_tokens.weight": to_numpy(model.embeddings.token[...])}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = w["norm1_scale"][i]
        t[p + "post_attention_layernorm.weight"] = w["norm2_scale"][i]
        for s, name in enumerate(("q_proj", "k_proj", "v_proj")):
            t[p + f"self_attn.{name}.weight"] = linear_weight(w["qkv_kernel"][i][:, s], 1)
        t[p + "self_attn.o_proj.weight"] = linear_weight(w["out_kernel"][i], 2)
        for ours, theirs in (("mlp_gate", "gate_proj"), ("mlp_up", "up_proj"),
                             ("mlp_out", "down_proj")):
            t[p + f"mlp.{theirs}.weight"] = linear_weight(w[f"{ours}_kernel"][i], 1)
    t["model.norm.weight"] = to_numpy(model.head.norm_scale[...])
    t["lm_head.weight"] = np.ascontiguousarray(to_numpy(model.head.kernel[...]).T)
    return t


def _common(cfg: ModelConfig, token_ids: dict[str, int | None]) -> dict[str, Any]:
    return {"vocab_size": cfg.vocab_size, "initializer_range": cfg.init_std, "use_cache": True,
            **token_ids}


def gpt2_config(cfg: ModelConfig, token_ids: dict[str, int | None]) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_embd": cfg.d_model, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
        "n_inner": cfg.hidden_dim, "n_positions": cfg.max_seq_len,
        "activation_function": "gelu_new",  # the tanh GELU of the gpt2 flavour
        "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, **_common(cfg, token_ids),
    }


def llama_config(cfg: ModelConfig, token_ids: dict[str, int | None]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.hidden_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x name ...
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # ... 5.x
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "pretraining_tp": 1, **_common(cfg, token_ids),
    }


def sequential_export(model, token_ids: dict[str, int | None]):
    """(tensors, config.json dict) of a ``SequentialLM`` for its flavour's stock class."""
    cfg: ModelConfig = model.config
    check_sequential(cfg)
    if cfg.flavour == "gpt2":
        return gpt2_tensors(model), gpt2_config(cfg, token_ids)
    if cfg.flavour == "llama":
        return llama_tensors(model), llama_config(cfg, token_ids)
    config = neox_config(cfg, token_ids)
    config["use_parallel_residual"] = False
    return neox_tensors(model), config
