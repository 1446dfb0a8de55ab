"""Time embedding of the DiffEqFormer: sinusoidal features φ(t) and the per-weight time MLP g(t).

φ(t) = [t, sin(s·t·ω_k), cos(s·t·ω_k)], k = 0..S-1, ω_k = exp(-ln(10000)·k/S), s = 1000 (the
paper's code: unscaled t first, then the sin block, then the cos block, no 2π). It has no
parameters and is shared by all time-dependent layers; every layer has its own g.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models.common import make_param, normal_init
from ode_lm.models.config import ModelConfig


def sinusoidal_features(
    t: jax.Array | float, sinusoidal_dim: int, scale: float = 1000.0, max_period: float = 10000.0
) -> jax.Array:
    """φ(t) in float32, shape ``t.shape + (2S+1,)``."""
    t = jnp.asarray(t, dtype=jnp.float32)
    k = jnp.arange(sinusoidal_dim, dtype=jnp.float32)
    omega = jnp.exp(-math.log(max_period) * k / sinusoidal_dim)
    arg = scale * t[..., None] * omega
    return jnp.concatenate([t[..., None], jnp.sin(arg), jnp.cos(arg)], axis=-1)


def time_features(config: ModelConfig, t: jax.Array | float) -> jax.Array:
    return sinusoidal_features(t, config.sinusoidal_dim, config.time_scale,
                               config.time_max_period)


class TimeMLP(nnx.Module):
    """g(t) = W₂·silu(W₁·φ(t) + b₁) + b₂, sizes 2S+1 → D → D.

    Init: W₁ ~ N(0, 1/(2S+1)), W₂ ~ N(0, 1/D) (LeCun normal), biases zero, so g is O(1).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        f, d = config.time_feature_dim, config.time_embed_dim
        normal = normal_init
        self.w1 = make_param(rngs.params(), normal(f**-0.5), (f, d),
                             ("time_features", "time_hidden"))
        self.b1 = make_param(rngs.params(), nnx.initializers.zeros, (d,), ("time_hidden",))
        self.w2 = make_param(rngs.params(), normal(d**-0.5), (d, d), ("time_hidden", "time_embed"))
        self.b2 = make_param(rngs.params(), nnx.initializers.zeros, (d,), ("time_embed",))

    def __call__(self, features: jax.Array) -> jax.Array:
        h = jax.nn.silu(features @ self.w1[...] + self.b1[...])
        return h @ self.w2[...] + self.b2[...]
