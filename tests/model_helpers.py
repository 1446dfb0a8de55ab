"""Tiny models shared by the model, export, generation, analysis and checkpoint tests, and
the uncached greedy decoder the KV-cached generation is checked against."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ode_lm.models import ModelConfig, build_model
from ode_lm.models.solve import Solve

# The smallest model that still has every part (2 heads, a time MLP, 2 solver steps).
TINY = dict(vocab_size=64, d_model=32, num_heads=2, max_seq_len=32, num_steps=2,
            time_embed_dim=4, sinusoidal_dim=4)
# TINY with larger initial weights, more time features and partial rotary (neox): its
# logits are far enough apart that greedy decoding and exported forwards see real differences.
LIVELY = dict(TINY, num_steps=3, sinusoidal_dim=8, rotary_fraction=0.5, init_std=0.2)


def tiny_config(base: dict = TINY, **overrides) -> ModelConfig:
    """``ModelConfig`` of ``base`` (TINY or LIVELY) with ``overrides``."""
    return ModelConfig(**{**base, **overrides})


def tiny_model(base: dict = TINY, seed: int = 0, **overrides) -> nnx.Module:
    """The model of ``tiny_config(base, **overrides)``, initialised from ``seed``."""
    return build_model(tiny_config(base, **overrides), nnx.Rngs(seed))


def greedy_uncached(model: nnx.Module, prompt: Sequence[int], max_new_tokens: int, *,
                    num_steps: int | None = None, solver: str | None = None,
                    rtol: float | None = None, atol: float | None = None) -> np.ndarray:
    """Reference decoding: the full forward over the whole sequence for every new token.

    The sequence lives in a fixed [1, P + max_new_tokens] buffer (causal attention makes the
    unused tail irrelevant to earlier positions), so the forward compiles once.
    """
    n = len(prompt)
    buf = np.zeros((1, n + max_new_tokens), np.int32)
    buf[0, :n] = prompt

    @nnx.jit
    def fwd(m, tokens):
        return m(tokens, solve=Solve.of(num_steps, solver, rtol, atol))[0]

    for i in range(max_new_tokens):
        logits = fwd(model, jnp.asarray(buf))
        buf[0, n + i] = int(jnp.argmax(logits[n + i - 1]))
    return buf[0, n:].copy()
