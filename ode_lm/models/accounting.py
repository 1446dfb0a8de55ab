"""Parameter and FLOP accounting for every model (the trainer's MFU, the pod planner, README).

FLOPs count 2 per multiply-add and only matmuls ("model FLOPs", the MFU convention): remat
recomputation is not counted. Per vector-field evaluation and token:
- dense maps: 2·In·Out each (qkv, out, MLP in/gate/up, MLP out);
- causal attention: QKᵀ and AV each 2·E·(T+1)/2 on average over positions;
- the head: 2·E·V.
The ODE runs N·stages evaluations (Euler 1, midpoint 2, RK4 4 per step). Generating the
weights for one evaluation costs 2·D·In·Out per matrix (plus the time MLPs, bias and norm
factors), independent of the batch, so per token it is divided by ``tokens_per_batch``.
Training = 3 × forward (backward = 2 × forward), for weight generation too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from ode_lm.models.config import ModelConfig
from ode_lm.models.solvers import num_stages
from ode_lm.models.vector_field import dense_specs
from ode_lm.partitioning import path_name


def param_count(params: Any, trainable: Callable[[str, Any], bool] | None = None
                ) -> dict[str, int]:
    """The one parameter count (model reports, the trainer's log, the AOT report, the bench,
    fine-tuning): total, embeddings, head, norms, hypernetwork (ODE) or blocks (discrete), the
    time-MLP subtotal, ``lora`` (the factors of a ``LoRAModel``, whose wrapped model's
    parameters count as usual) and ``trainable`` (those ``trainable(path, leaf)`` selects, by
    their ``partitioning.path_name``; every one without a predicate).

    ``params``: a model, its Param state, or a params pure dict; abstract leaves
    (``nnx.eval_shape``, ``ShapeDtypeStruct``) count the same."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    out = {"total": 0, "embeddings": 0, "head": 0, "norms": 0, "hypernetwork": 0, "blocks": 0,
           "time_mlps": 0, "lora": 0, "trainable": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_name(path)
        n = math.prod(leaf.shape)
        out["total"] += n
        if trainable is None or trainable(name, leaf):
            out["trainable"] += n
        keys = name.split("/")
        if keys[0] == "base":  # the model a LoRAModel wraps
            keys = keys[1:]
        if "time_mlp" in keys:
            out["time_mlps"] += n
        if keys[0] == "lora":
            out["lora"] += n
        elif keys[0] == "embeddings":
            out["embeddings"] += n
        elif keys[0] == "head":
            out["norms" if keys[1].startswith("norm") else "head"] += n
        elif keys[0] == "block":
            out["norms" if keys[1] in ("norm1", "norm2") else "hypernetwork"] += n
        elif keys[0] == "blocks":
            out["norms" if keys[-1].startswith("norm") else "blocks"] += n
        else:
            raise ValueError(f"param_count: unexpected parameter path {name}")
    return out


def config_param_count(config: ModelConfig) -> dict[str, int]:
    """``param_count`` of the model a config builds, without allocating it."""
    from ode_lm.models import build_model

    return param_count(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    forward: float  # per token, everything included
    training: float  # per token: 3 × forward
    block_forward: float  # per token: dense maps + attention over all evaluations
    head_forward: float  # per token
    weight_generation_per_batch: float  # forward FLOPs to generate all W(t) once per batch
    evaluations: int  # vector-field evaluations (N·stages) or layers


def _generation_flops_per_eval(config: ModelConfig) -> float:
    if not config.time_dependent:
        return 0.0
    d, f, e = config.time_embed_dim, config.time_feature_dim, config.d_model
    time_mlp = 2 * (f * d + d * d)
    total = 0.0
    for s in dense_specs(config).values():
        n_in, n_out = math.prod(s.in_shape), math.prod(s.out_shape)
        total += 2 * d * n_in * n_out + time_mlp + (2 * d * n_out if s.use_bias else 0)
    norm_factors = 2 if config.flavour != "llama" else 1
    total += 2 * (time_mlp + norm_factors * 2 * d * e)
    return total


def flops_per_token(
    config: ModelConfig,
    num_steps: int | None = None,
    *,
    solver: str | None = None,
    seq_len: int | None = None,
    tokens_per_batch: int | None = None,
) -> FlopsPerToken:
    """Forward and training FLOPs per token.

    num_steps/solver: ODE settings (default: the config's); discrete models use num_layers.
    seq_len: attention context (default ``max_seq_len``).
    tokens_per_batch: tokens sharing one weight generation (global batch × seq_len); default
      ``seq_len`` (one sequence), the most conservative choice.
    """
    t = config.max_seq_len if seq_len is None else seq_len
    tokens = t if tokens_per_batch is None else tokens_per_batch
    if t < 1 or tokens < 1:
        raise ValueError(f"flops_per_token: seq_len={t} and tokens_per_batch={tokens} must be >= 1")
    e = config.d_model
    dense = sum(2 * math.prod(s.in_shape) * math.prod(s.out_shape)
                for s in dense_specs(config).values())
    attention = 2 * 2 * e * (t + 1) / 2
    if config.architecture == "ode":
        n = config.num_steps if num_steps is None else num_steps
        evals = n * num_stages(config.solver if solver is None else solver)
        generation = evals * _generation_flops_per_eval(config)
    else:
        evals, generation = config.num_layers, 0.0
    block = evals * (dense + attention)
    head = 2 * e * config.vocab_size
    forward = block + head + generation / tokens
    return FlopsPerToken(forward=forward, training=3 * forward, block_forward=block,
                         head_forward=head, weight_generation_per_batch=generation,
                         evaluations=evals)
