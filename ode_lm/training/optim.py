"""Optimizer: clip_by_global_norm then AdamW with a weight-decay mask, warmup + cosine.

The weight-decay mask is a predicate on parameter *paths* (``'vector_field/attn/qkv/w0'``)
and leaves. ``'paper'`` is the preset used for the paper's runs: decay every matrix
(kernels and hypernetwork coefficients), never biases, norm scales or embeddings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import optax

from ode_lm.config_types import (
    check_types,
    require,
    require_at_least,
    require_fraction,
    require_positive,
)
from ode_lm.partitioning import path_name  # noqa: F401  (re-exported: optim.path_name)

MaskPredicate = Callable[[str, Any], bool]

# Parameters whose path matches this never get weight decay in the paper preset.
PAPER_NO_DECAY_REGEX = r"(bias|scale|norm|embed|wte|wpe|position)"
MASK_PRESETS = ("paper", "all", "none")  # OptimizerConfig.weight_decay_mask, or a regex


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of the optax chain (bound by gin as ``OptimizerConfig.*``)."""

    learning_rate: float = 6e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    weight_decay_mask: str | MaskPredicate | None = "paper"  # 'paper' | 'all' | 'none' | regex
    clip_norm: float | None = 1.0

    def __post_init__(self):
        check_types(self)
        require_positive(self, "learning_rate", "eps")
        require_at_least(self, 0, "warmup_steps", "weight_decay", "clip_norm")
        require_fraction(self, "min_lr_ratio", closed=True)
        require_fraction(self, "b1")
        require_fraction(self, "b2")
        mask = self.weight_decay_mask
        if isinstance(mask, str) and mask not in MASK_PRESETS:
            try:
                re.compile(mask)
            except re.error as e:
                require(self, "weight_decay_mask", False,
                        f"not {' / '.join(MASK_PRESETS)} nor a regex: {e}")
        require(self, "weight_decay_mask", mask is None or isinstance(mask, str) or callable(mask),
                "expected a preset, a regex of paths or a callable(path, leaf)")


def paper_decay(path: str, leaf: Any) -> bool:
    """The paper preset: decay matrices (ndim >= 2) except embeddings; never vectors."""
    return getattr(leaf, "ndim", 0) >= 2 and not re.search(PAPER_NO_DECAY_REGEX, path)


def make_mask_predicate(spec: str | MaskPredicate | None) -> MaskPredicate:
    """'paper' | 'all' | 'none' | None | a regex of paths to decay | a callable(path, leaf)."""
    if callable(spec):
        return spec
    if spec in (None, "none"):
        return lambda path, leaf: False
    if spec == "all":
        return lambda path, leaf: True
    if spec == "paper":
        return paper_decay
    try:
        pattern = re.compile(spec)
    except re.error as e:
        raise ValueError(f"OptimizerConfig.weight_decay_mask={spec!r} is not a regex: {e}") from e
    return lambda path, leaf: bool(pattern.search(path))


def weight_decay_mask(params: Any, spec: str | MaskPredicate | None) -> Any:
    """A pytree of bools like ``params``: True where weight decay applies."""
    predicate = make_mask_predicate(spec)
    return jax.tree_util.tree_map_with_path(lambda p, x: predicate(path_name(p), x), params)


def learning_rate_schedule(config: OptimizerConfig, num_train_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay to ``learning_rate * min_lr_ratio``."""
    warmup = min(config.warmup_steps, max(num_train_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(num_train_steps, warmup + 1),
        end_value=config.learning_rate * config.min_lr_ratio,
    )


def make_optimizer(
    config: OptimizerConfig, num_train_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """clip_by_global_norm -> AdamW(schedule, mask); returns (tx, schedule)."""
    schedule = learning_rate_schedule(config, num_train_steps)
    parts = []
    if config.clip_norm is not None and config.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(config.clip_norm))
    parts.append(
        optax.adamw(
            schedule,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=lambda params: weight_decay_mask(params, config.weight_decay_mask),
        )
    )
    return optax.chain(*parts), schedule
