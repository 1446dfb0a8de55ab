"""Discrete baselines built from the same block code as the ODE vector field.

- ``SequentialLM`` (``architecture='sequential'``): pre-norm blocks x ← x + Attn(Norm1(x)),
  x ← x + MLP(Norm2(x)). GPT-2 flavour is exactly GPT-2 (124,439,808 parameters for GPT-2
  small); Llama flavour is a vanilla Llama (RMSNorm, RoPE, SwiGLU, untied head).
- ``ParallelLM`` (``architecture='parallel'``): parallel blocks x ← x + Attn(Norm1(x)) +
  MLP(Norm2(x)), i.e. one Euler step of the ODE with dt folded into the output projections.
  It is what ``materialize`` returns, and with the NeoX flavour it is GPT-NeoX/Pythia.

The L layers' weights are stacked on a leading ``layers`` axis (same names as the block
weight dict of vector_field.py) and applied with a ``lax.scan`` under the same remat policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models.common import (
    attention_mask,
    make_param,
    normal_init,
    remat_policy,
)
from ode_lm.models.config import ModelConfig
from ode_lm.models.embeddings import LanguageModel
from ode_lm.models.solve import OWN, Solve
from ode_lm.models.vector_field import (
    BlockWeights,
    dense_specs,
    kernel_std,
    parallel_residual,
    sequential_residual,
    weight_spec,
)


def _init_for(config: ModelConfig, name: str, num_layers: int):
    if name.endswith("_scale"):
        return nnx.initializers.ones
    if name.endswith("_bias"):
        return nnx.initializers.zeros
    layer = name[: -len("_kernel")]
    residual_scaled = config.architecture == "sequential"
    std = kernel_std(config, layer, num_layers if residual_scaled else None)
    assert layer in dense_specs(config)
    return normal_init(std)


class StackedBlocks(nnx.Module):
    """Static block weights for L layers: name → Param [L, *shape] with axes ('layers', ...)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        n = config.num_layers
        self.weights = nnx.Dict({
            name: make_param(rngs.params(), _init_for(config, name, n), (n,) + shape,
                             ("layers",) + axes)
            for name, (shape, axes) in weight_spec(config).items()
        })

    def stacked(self) -> BlockWeights:
        return {name: p[...] for name, p in self.weights.items()}


class _DiscreteLM(LanguageModel):
    def build_body(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.blocks = StackedBlocks(config, rngs)

    def body(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        solve: Solve = OWN,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
        return_stats: bool = False,
    ):
        """The L layers from x₀ (discrete depth: only the model's own solve, ``Solve()``);
        ``return_stats`` adds ``{"nfe": num_layers}`` (one block evaluation per layer)."""
        cfg = self.config
        if solve.changes():
            raise ValueError(f"{type(self).__name__}: cannot run the solve {solve.describe()}: "
                             f"a discrete model runs its {cfg.num_layers} layers (no solve)")
        mask = attention_mask(segment_ids)
        residual = parallel_residual if cfg.architecture == "parallel" else sequential_residual
        use_dropout = not deterministic and cfg.dropout_rate > 0
        if use_dropout and rngs is None:
            raise ValueError(f"{type(self).__name__}: deterministic=False with dropout_rate > 0 "
                             "needs rngs=nnx.Rngs(dropout=...)")
        keys = jax.random.split(rngs.dropout(), cfg.num_layers) if use_dropout else None

        def layer(x, xs):
            w, key = xs
            if cfg.architecture == "parallel":
                return x + residual(cfg, w, x, positions, mask, key,
                                    segment_ids=segment_ids), None
            return residual(cfg, w, x, positions, mask, key, segment_ids=segment_ids), None

        layer = jax.checkpoint(layer, policy=remat_policy(cfg.remat))
        x, _ = jax.lax.scan(layer, x, (self.blocks.stacked(), keys))
        return (x, {"nfe": jnp.asarray(cfg.num_layers, jnp.int32)}) if return_stats else x


class SequentialLM(_DiscreteLM):
    """Vanilla pre-norm transformer (GPT-2 / Llama)."""

    _architecture = "sequential"


class ParallelLM(_DiscreteLM):
    """Parallel-block transformer (GPT-NeoX style); the family ``materialize`` returns."""

    _architecture = "parallel"
