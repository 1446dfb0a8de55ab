"""ode-lm models: the DiffEqFormer (Neural ODE transformer) and its discrete baselines.

The model classes are imported when first asked for, so ``models.config`` and
``models.solve`` (the settings, no jax) stay light for the commands that only read files."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ode_lm.models.config import ModelConfig
from ode_lm.models.solve import Solve

if TYPE_CHECKING:
    from flax import nnx

    from ode_lm.models.lm import DiffEqFormer, weights_at

__all__ = ["ModelConfig", "DiffEqFormer", "Solve", "build_model", "weights_at"]


def __getattr__(name: str) -> Any:
    if name in ("DiffEqFormer", "weights_at"):
        from ode_lm.models import lm

        return getattr(lm, name)
    raise AttributeError(f"module 'ode_lm.models' has no attribute {name!r}")


def build_model(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The model for ``config.architecture`` (ode | sequential | parallel) and flavour."""
    if config.architecture == "ode":
        from ode_lm.models.lm import DiffEqFormer

        return DiffEqFormer(config, rngs)
    from ode_lm.models.baselines import ParallelLM, SequentialLM

    if config.architecture == "parallel":
        return ParallelLM(config, rngs)
    return SequentialLM(config, rngs)
