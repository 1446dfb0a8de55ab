"""ode-lm models: the DiffEqFormer (Neural ODE transformer) and its discrete baselines."""

from __future__ import annotations

from flax import nnx

from ode_lm.models.config import ModelConfig
from ode_lm.models.lm import DiffEqFormer, weights_at

__all__ = ["ModelConfig", "DiffEqFormer", "build_model", "weights_at"]


def build_model(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The model for ``config.architecture`` (ode | sequential | parallel) and flavour."""
    if config.architecture == "ode":
        return DiffEqFormer(config, rngs)
    from ode_lm.models.baselines import ParallelLM, SequentialLM

    if config.architecture == "parallel":
        return ParallelLM(config, rngs)
    return SequentialLM(config, rngs)
