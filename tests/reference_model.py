"""Load the paper's own parameters (qkvflow ``NeuralOdeLMHeadModel``, GPT-2 flavour) into a
DiffEqFormer. Used by the parity test against ``shared/reference/qkvflow_micro_perturbed.npz``.

Mapping (qkvflow path → ode-lm):
  embeddings/token_embeddings, position_embeddings → embeddings.token, embeddings.position
  transformer/ln_f/{weight,bias}                   → head.norm_scale, head.norm_bias
  block/{attn_ln,mlp_ln}: lin1/lin2, f_weight, f_bias → block.norm{1,2}: time_mlp, f_wᵀ, f_bᵀ
  block/attn/c_attn, attn/c_proj, mlp/c_fc, mlp/c_proj → block.layers[qkv|out|mlp_in|mlp_out]:
      lin1/weight, lin1/bias, lin2/weight, lin2/bias → time_mlp.w1, b1, w2, b2
      f_W/weight (D, in, out) → a;  f_W/bias (in, out) → w0 (the static part of W);  f_b → f_b
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
from flax import nnx

from ode_lm.models.config import ModelConfig
from ode_lm.models.lm import DiffEqFormer

_DENSE = {"attn/c_attn": "qkv", "attn/c_proj": "out", "mlp/c_fc": "mlp_in", "mlp/c_proj": "mlp_out"}
_NORMS = {"attn_ln": "norm1", "mlp_ln": "norm2"}


def reference_config(meta: Mapping) -> ModelConfig:
    """ModelConfig equivalent to the paper's micro config (``meta/config_json``)."""
    return ModelConfig(
        flavour="gpt2", architecture="ode", vocab_size=meta["vocab"], d_model=meta["hidden_dim"],
        num_heads=meta["num_heads"], mlp_dim=meta["mlp_dim"], max_seq_len=meta["seq_len"],
        num_steps=meta["num_layers"], solver="euler", time_embed_dim=meta["time_embed_dim"],
        sinusoidal_dim=meta["sinusoidal_dim"], time_scale=meta["sinusoidal_scale"],
        norm_eps=meta["layer_norm_epsilon"],
    )


def _set(var: nnx.Variable, value: np.ndarray, path: str) -> None:
    if tuple(var[...].shape) != tuple(value.shape):
        raise ValueError(f"load_qkvflow_reference: {path} has shape {value.shape}, "
                         f"ode-lm expects {tuple(var[...].shape)}")
    var[...] = np.asarray(value, np.float32)


def _time_mlp(mlp, params: Mapping, prefix: str) -> None:
    _set(mlp.w1, params[f"{prefix}/lin1/weight"], prefix)
    _set(mlp.b1, params[f"{prefix}/lin1/bias"], prefix)
    _set(mlp.w2, params[f"{prefix}/lin2/weight"], prefix)
    _set(mlp.b2, params[f"{prefix}/lin2/bias"], prefix)


def load_qkvflow_reference(source: str | os.PathLike | Mapping) -> DiffEqFormer:
    """A DiffEqFormer holding the paper's parameters.

    source: path of the ``.npz`` (with ``param/...`` and ``meta/config_json`` entries) or the
    loaded mapping itself.
    """
    data = np.load(source) if isinstance(source, (str, os.PathLike)) else source
    if "meta/config_json" not in data:
        raise ValueError("load_qkvflow_reference: no 'meta/config_json' entry in the source")
    config = reference_config(json.loads(str(data["meta/config_json"])))
    p = {k[len("param/"):]: np.asarray(data[k]) for k in data if k.startswith("param/")}
    model = DiffEqFormer(config, nnx.Rngs(0))
    _set(model.embeddings.token, p["embeddings/token_embeddings"], "token_embeddings")
    _set(model.embeddings.position, p["embeddings/position_embeddings"], "position_embeddings")
    _set(model.head.norm_scale, p["transformer/ln_f/weight"], "ln_f/weight")
    _set(model.head.norm_bias, p["transformer/ln_f/bias"], "ln_f/bias")
    for src, dst in _NORMS.items():
        prefix = f"transformer/block/{src}"
        norm = getattr(model.block, dst)
        _time_mlp(norm.time_mlp, p, prefix)
        _set(norm.f_w, p[f"{prefix}/f_weight"].T, f"{prefix}/f_weight")
        _set(norm.f_b, p[f"{prefix}/f_bias"].T, f"{prefix}/f_bias")
    for src, dst in _DENSE.items():
        prefix = f"transformer/block/{src}"
        layer = model.block.layers[dst]
        _time_mlp(layer.time_mlp, p, prefix)
        _set(layer.a, p[f"{prefix}/f_W/weight"], f"{prefix}/f_W/weight")
        _set(layer.w0, p[f"{prefix}/f_W/bias"], f"{prefix}/f_W/bias")
        _set(layer.f_b, p[f"{prefix}/f_b"], f"{prefix}/f_b")
    return model


def reference_param_paths() -> dict[str, str]:
    """qkvflow parameter path → ode-lm state path (for mapping gradients back and forth)."""
    out = {
        "embeddings/token_embeddings": "embeddings/token",
        "embeddings/position_embeddings": "embeddings/position",
        "transformer/ln_f/weight": "head/norm_scale",
        "transformer/ln_f/bias": "head/norm_bias",
    }
    for src, dst in _NORMS.items():
        for a, b in (("lin1/weight", "w1"), ("lin1/bias", "b1"), ("lin2/weight", "w2"),
                     ("lin2/bias", "b2")):
            out[f"transformer/block/{src}/{a}"] = f"block/{dst}/time_mlp/{b}"
        out[f"transformer/block/{src}/f_weight"] = f"block/{dst}/f_w"  # transposed
        out[f"transformer/block/{src}/f_bias"] = f"block/{dst}/f_b"  # transposed
    for src, dst in _DENSE.items():
        for a, b in (("lin1/weight", "w1"), ("lin1/bias", "b1"), ("lin2/weight", "w2"),
                     ("lin2/bias", "b2")):
            out[f"transformer/block/{src}/{a}"] = f"block/layers/{dst}/time_mlp/{b}"
        out[f"transformer/block/{src}/f_W/weight"] = f"block/layers/{dst}/a"
        out[f"transformer/block/{src}/f_W/bias"] = f"block/layers/{dst}/w0"
        out[f"transformer/block/{src}/f_b"] = f"block/layers/{dst}/f_b"
    return out
