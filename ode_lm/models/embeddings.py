"""Token/position embeddings, final norm and LM head shared by the ODE and discrete models.

GPT-2: learned absolute positions and a head tied to the token embedding.
Llama / NeoX: rotary positions (inside attention) and an untied head kernel [E, V].
Logits are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models.common import (
    BATCH_LENGTH_EMBED,
    BATCH_LENGTH_VOCAB,
    apply_norm,
    compute_dtype,
    constrain,
    default_inputs,
    make_param,
    normal_init,
)
from ode_lm.models.config import ModelConfig
from ode_lm.models.solve import OWN, Solve


class Embeddings(nnx.Module):
    """x₀ = wte[tokens] (+ wpe[positions] for GPT-2), float32 [B, T, E]."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        init = normal_init(config.init_std)
        self.token = make_param(rngs.params(), init, (config.vocab_size, config.d_model),
                                ("vocab", "embed"))
        self.position = (
            make_param(rngs.params(), init, (config.max_seq_len, config.d_model),
                       ("position", "embed"))
            if config.flavour == "gpt2" else None
        )

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        x = jnp.take(self.token[...], tokens, axis=0)
        if self.position is not None:
            x = x + jnp.take(self.position[...], positions, axis=0)
        return constrain(x, BATCH_LENGTH_EMBED)


class Head(nnx.Module):
    """Final norm (LayerNorm / RMSNorm) and the vocabulary projection (tied for GPT-2)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        e = config.d_model
        self.norm_scale = make_param(rngs.params(), nnx.initializers.ones, (e,), ("norm",))
        self.norm_bias = (
            make_param(rngs.params(), nnx.initializers.zeros, (e,), ("norm",))
            if config.flavour != "llama" else None
        )
        self.kernel = (
            None if config.tied_embeddings else
            make_param(rngs.params(), normal_init(config.init_std),
                       (e, config.vocab_size), ("embed", "vocab"))
        )

    def __call__(self, x: jax.Array, embeddings: Embeddings) -> jax.Array:
        cdt = compute_dtype(self.config)
        bias = None if self.norm_bias is None else self.norm_bias[...]
        h = apply_norm(self.config, x, self.norm_scale[...], bias).astype(cdt)
        if self.kernel is None:
            logits = jnp.einsum("bte,ve->btv", h, embeddings.token[...].astype(cdt),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bte,ev->btv", h, self.kernel[...].astype(cdt),
                                preferred_element_type=jnp.float32)
        return constrain(logits.astype(jnp.float32), BATCH_LENGTH_VOCAB)


class LanguageModel(nnx.Module):
    """What the ODE and the discrete models share: embeddings, a body, a head.

    A subclass names its ``_architecture`` and builds its body in ``build_body``, which runs
    between the embeddings and the head, so the params stream is drawn in that order."""

    _architecture = ""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        if config.architecture != self._architecture:
            raise ValueError(f"{type(self).__name__}: ModelConfig.architecture="
                             f"{config.architecture!r}, expected {self._architecture!r}")
        self.config = config
        self.embeddings = Embeddings(config, rngs)
        self.build_body(config, rngs)
        self.head = Head(config, rngs)

    def build_body(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        raise NotImplementedError

    def body(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, *,
             solve: Solve, deterministic: bool = True, rngs: nnx.Rngs | None = None,
             return_stats: bool = False):
        """x₀ → the state before the head (and ``{"nfe": ...}`` with ``return_stats``)."""
        raise NotImplementedError

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        solve: Solve | None = None,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
        return_stats: bool = False,
    ):
        """Logits float32 [B, T, V]: embed → body → head (and the body's stats, e.g.
        ``{"nfe": ...}``, with ``return_stats``). ``solve`` (``models.solve.Solve``; None:
        the model's own) is how the body integrates; ``deterministic=False`` with ``rngs``
        is a training forward (dropout, the random grid offset). A discrete model refuses a
        solve it cannot run."""
        positions, segment_ids = default_inputs(tokens, positions, segment_ids)
        out = self.body(self.embeddings(tokens, positions), positions, segment_ids,
                        solve=OWN if solve is None else solve,
                        deterministic=deterministic, rngs=rngs, return_stats=return_stats)
        return (self.logits(out[0]), out[1]) if return_stats else self.logits(out)

    def embed(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """x₀, float32 [B, T, E]."""
        positions, _ = default_inputs(tokens, positions, None)
        return self.embeddings(tokens, positions)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm + head, float32 [B, T, V]."""
        return self.head(x, self.embeddings)
