"""Time-dependent (hypernetwork) layers: W(t) = W₀ + Σ_d g_d(t)·A_d, b(t) = g(t)·F_b,
norm gain(t) = 1 + g(t)·F_w and bias(t) = g(t)·F_b.

The layers only *generate* static weights for a time t (``generate``); applying them is the
job of the pure block functions in vector_field.py. With ``time_dependent=False`` the same
classes hold plain static weights (the autonomous, weight-shared ODE ablation).

Initialisation (so that W(t) has the baseline kernel's scale σ = ``init_std`` at every t):
W₀ ~ N(0, σ²/2), A ~ N(0, σ²/(2·D·m)) where m is the mean of g_d(t)² over t ∈ [0, 1] at init,
so E[W(t)²] ≈ σ²; bias and norm factors F start at zero (gain 1, bias 0 as in the baseline).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models.common import constrain, make_param, normal_init
from ode_lm.models.config import ModelConfig
from ode_lm.models.time_embedding import TimeMLP, time_features

_INIT_GRID = 64  # t points used to measure the mean g(t)² at init


@jax.custom_vjp
def generate_kernel(g: jax.Array, w0: jax.Array, a: jax.Array) -> jax.Array:
    """W = W₀ + Σ_d g[..., d]·A[d, ...]: g [*K, D], W₀ [*P], A [D, *P] → [*K, *P].

    The custom backward computes dA = Σ_k g[k] ⊗ dW[k] and dW₀ = Σ_k dW[k] as contractions
    straight into A's [D, *P] layout. Autodiff's rule yields [*P, D] plus a transpose of the
    whole coefficient tensor and a separate reduction, which on CPU cost more than the
    contraction itself.
    """
    with jax.named_scope("weight_generation"):
        return w0 + jnp.tensordot(g, a, axes=1)


def _generate_kernel_fwd(g, w0, a):
    return generate_kernel(g, w0, a), (g, a)


def _generate_kernel_bwd(res, ct):
    g, a = res
    k, p = g.ndim - 1, a.ndim - 1
    batch = tuple(range(k))
    with jax.named_scope("weight_generation_grad"):
        ct = ct.astype(a.dtype)
        dg = jnp.tensordot(ct, a, axes=(tuple(range(k, k + p)), tuple(range(1, 1 + p))))
        da = jnp.tensordot(g.astype(a.dtype), ct, axes=(batch, batch))
        dw0 = jnp.tensordot(jnp.ones(g.shape[:-1], a.dtype), ct, axes=(batch, batch)) if k else ct
    return dg.astype(g.dtype), dw0, da


generate_kernel.defvjp(_generate_kernel_fwd, _generate_kernel_bwd)


def _mean_square_g(time_mlp: TimeMLP, config: ModelConfig) -> jax.Array:
    t = jnp.linspace(0.0, 1.0, _INIT_GRID)
    return jnp.mean(jnp.square(time_mlp(time_features(config, t))))


class TemporalDense(nnx.Module):
    """A kernel W(t) of shape in_shape + out_shape with optional bias b(t) of shape out_shape."""

    def __init__(
        self,
        config: ModelConfig,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        in_axes: Sequence[str],
        out_axes: Sequence[str],
        *,
        use_bias: bool,
        std: float,
        rngs: nnx.Rngs,
    ):
        self.time_dependent = config.time_dependent
        self.kernel_axes = tuple(in_axes) + tuple(out_axes)
        self.out_axes = tuple(out_axes)
        self.in_ndim = len(in_shape)
        shape = tuple(in_shape) + tuple(out_shape)
        normal = normal_init
        zeros = nnx.initializers.zeros
        d = config.time_embed_dim

        def param(init, shp, axes):
            return make_param(rngs.params(), init, shp, axes)

        if self.time_dependent:
            self.time_mlp = TimeMLP(config, rngs)
            self.w0 = param(normal(std * 0.5**0.5), shape, self.kernel_axes)
            a_std = std * (0.5 / (d * _mean_square_g(self.time_mlp, config))) ** 0.5
            self.a = param(normal(a_std), (d,) + shape, ("time_embed",) + self.kernel_axes)
            out = (d,) + tuple(out_shape)
            self.f_b = param(zeros, out, ("time_embed",) + self.out_axes) if use_bias else None
        else:
            self.w0 = param(normal(std), shape, self.kernel_axes)
            self.bias = param(zeros, tuple(out_shape), self.out_axes) if use_bias else None

    def generate(self, features: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(W(t), b(t)) in float32 for features φ(t) of shape [2S+1], or [K, 2S+1] for K
        times at once (then W is [K, *kernel]: one [K, D] × [D, P] contraction that reads
        the coefficients A once, which is what ``weight_generation='precompute'`` uses)."""
        if not self.time_dependent:
            bias = None if self.bias is None else self.bias[...]
            return self.w0[...], bias
        g = self.time_mlp(features)
        kernel = generate_kernel(g, self.w0[...], self.a[...])
        kernel = constrain(kernel, (None,) * (g.ndim - 1) + self.kernel_axes)
        bias = None if self.f_b is None else jnp.tensordot(g, self.f_b[...], axes=1)
        return kernel, bias


class TemporalNorm(nnx.Module):
    """gain(t) = 1 + g(t)·F_w, bias(t) = g(t)·F_b (LayerNorm only); F zero-initialised."""

    def __init__(self, config: ModelConfig, *, use_bias: bool, rngs: nnx.Rngs):
        self.time_dependent = config.time_dependent
        e, d = config.d_model, config.time_embed_dim
        zeros, ones = nnx.initializers.zeros, nnx.initializers.ones
        if self.time_dependent:
            self.time_mlp = TimeMLP(config, rngs)
            self.f_w = make_param(rngs.params(), zeros, (d, e), ("time_embed", "norm"))
            self.f_b = (
                make_param(rngs.params(), zeros, (d, e), ("time_embed", "norm"))
                if use_bias else None
            )
        else:
            self.scale = make_param(rngs.params(), ones, (e,), ("norm",))
            self.bias = make_param(rngs.params(), zeros, (e,), ("norm",)) if use_bias else None

    def generate(self, features: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(gain(t), bias(t)) in float32, each [d_model] (bias None for RMSNorm)."""
        if not self.time_dependent:
            return self.scale[...], None if self.bias is None else self.bias[...]
        g = self.time_mlp(features)
        gain = 1.0 + g @ self.f_w[...]
        bias = None if self.f_b is None else g @ self.f_b[...]
        return gain, bias
