"""The analysis' view of a model: weights per depth point, a pure vector field, embeddings.

The math in spectra.py / lyapunov.py works on generic inputs (stacked weight arrays, a
vector-field callable). This module turns an ode-lm model into those inputs:

* ODE (DiffEqFormer): ``weights_at(t)`` for any t in [0, 1] (vmapped in chunks over t), and
  its ``vector_field(x, t, positions)``.
* Discrete baselines (sequential / parallel blocks): the per-layer block weights, and the
  layer map written as a piecewise-constant vector field so that Euler with L steps over
  [0, 1] reproduces the forward pass exactly (see ``discrete_field``).

Parameters travel as jit *arguments* (``nnx.split`` → state), never as captured constants,
so a 100 MB model does not get embedded into every compiled program.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ode_lm.models.common import attention_mask
from ode_lm.models.config import ModelConfig
from ode_lm.models.vector_field import (
    attention_branch,
    block_norm,
    mlp_branch,
    parallel_residual,
    sequential_residual,
)


def is_ode(model) -> bool:
    return model.config.architecture == "ode"


def canonical_weights(w: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Block weights (layout of models/vector_field.py, stacked over P) → spectra's keys.

    qkv_kernel ``[P, E, 3, H, Dh]`` → w_q/w_k/w_v ``[P, H, E, Dh]``; out_kernel ``[P, H, Dh, E]``
    → w_o; W₁ = mlp_in_kernel (GPT-2 / NeoX) or mlp_up_kernel (Llama's SwiGLU: the linear
    path; the gate only modulates it), W₂ = mlp_out_kernel.
    """
    qkv = np.asarray(w["qkv_kernel"])
    w1_name = "mlp_up_kernel" if config.flavour == "llama" else "mlp_in_kernel"
    return {
        "w_q": np.moveaxis(qkv[:, :, 0], 1, 2),
        "w_k": np.moveaxis(qkv[:, :, 1], 1, 2),
        "w_v": np.moveaxis(qkv[:, :, 2], 1, 2),
        "w_o": np.asarray(w["out_kernel"]),
        "mlp_w1": np.asarray(w[w1_name]),
        "mlp_w2": np.asarray(w["mlp_out_kernel"]),
    }


_SPECTRAL_KEYS = ("qkv_kernel", "out_kernel", "mlp_in_kernel", "mlp_up_kernel", "mlp_out_kernel")


def ode_weights_at(model, ts: np.ndarray, chunk: int = 16):
    """Yield (t_chunk, canonical weights) for the ODE model, ``chunk`` t values at a time.

    Chunking bounds memory: all generated matrices of 101 t values of cpu_small would be
    ~320 MB in float32.
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def gen(state, tc):
        m = nnx.merge(graphdef, state)
        w = jax.vmap(m.weights_at)(tc)
        return {k: v for k, v in w.items() if k in _SPECTRAL_KEYS}

    ts = np.asarray(ts, np.float32)
    for start in range(0, len(ts), chunk):
        tc = ts[start:start + chunk]
        padded = np.pad(tc, (0, chunk - len(tc)), mode="edge")  # one compiled shape
        w = jax.device_get(gen(state, jnp.asarray(padded)))
        yield tc, canonical_weights({k: v[: len(tc)] for k, v in w.items()}, model.config)


def ode_field(model) -> tuple[Callable, tuple]:
    """(field(x, t, state, positions), (state,)) for one sequence x ``[T, E]``."""
    graphdef, state = nnx.split(model)

    def field(x, t, state, positions):
        m = nnx.merge(graphdef, state)
        return m.vector_field(x[None], t, positions[None])[0]

    return field, (state,)


def ode_split(model) -> tuple[Callable, Callable]:
    """f = Attn(Norm1(x)) + MLP(Norm2(x)) split into its token-mixing and per-token parts.

    Same signature as ``ode_field``; ``local`` takes one token's state ``[E]``. Used by the
    Lyapunov Jacobians so the MLP backward runs for the output token only (lyapunov.py).
    """
    graphdef, _ = nnx.split(model)
    cfg = model.config

    def mixing(x, t, state, positions):
        w = nnx.merge(graphdef, state).weights_at(t)
        mask = attention_mask(jnp.ones((1, x.shape[0]), jnp.int32))
        h = block_norm(cfg, w, "norm1", x[None])
        out, _ = attention_branch(cfg, w, h, positions[None], mask)
        return out[0].astype(jnp.float32)

    def local(v, t, state, positions):
        del positions
        w = nnx.merge(graphdef, state).weights_at(t)
        h = block_norm(cfg, w, "norm2", v[None, None])
        return mlp_branch(cfg, w, h)[0, 0].astype(jnp.float32)

    return mixing, local


def num_layers(model) -> int:
    """Depth L of a discrete baseline."""
    return int(model.config.num_layers)


def layer_canonical_weights(model) -> dict[str, np.ndarray]:
    """The baseline's per-layer weights (stacked ``[L, ...]``) in spectra's layout."""
    return canonical_weights(jax.device_get(model.blocks.stacked()), model.config)


def _layer_update(config: ModelConfig, w, x, positions):
    """F_l(x) with x_{l+1} = x_l + F_l(x_l), for one sequence ``[T, E]``."""
    mask = attention_mask(jnp.ones((1, x.shape[0]), jnp.int32))
    if config.architecture == "parallel":
        return parallel_residual(config, w, x[None], positions[None], mask)[0]
    return sequential_residual(config, w, x[None], positions[None], mask)[0] - x


def discrete_field(model) -> tuple[Callable, tuple]:
    """A baseline as the piecewise-constant field f(x, t) = L·F_l(x), l = round(t·L) − 1.

    Euler with dt = 1/L evaluates f at t_{l+1} = (l+1)/L, so x + dt·f(x, t_{l+1}) =
    x + F_l(x): exactly layer l. Exponents are then per unit depth, comparable to the ODE's.
    """
    graphdef, state = nnx.split(model)
    cfg = model.config
    depth = num_layers(model)

    def field(x, t, state, positions):
        stacked = nnx.merge(graphdef, state).blocks.stacked()
        layer = jnp.clip(jnp.round(t * depth).astype(jnp.int32) - 1, 0, depth - 1)
        w = jax.tree.map(lambda a: a[layer], stacked)
        return depth * _layer_update(cfg, w, x, positions)

    return field, (state,)


def layer_states(model, tokens: np.ndarray) -> np.ndarray:
    """Residual stream of a baseline after every layer: ``[L+1, T, E]`` (embeddings first)."""
    graphdef, state = nnx.split(model)
    cfg = model.config

    @jax.jit
    def run(state, toks):
        m = nnx.merge(graphdef, state)
        x = m.embed(toks[None])[0]
        positions = jnp.arange(toks.shape[0], dtype=jnp.int32)

        def layer(x, w):
            y = x + _layer_update(cfg, w, x, positions)
            return y, y

        _, ys = jax.lax.scan(layer, x, m.blocks.stacked())
        return jnp.concatenate([x[None], ys])

    return np.asarray(run(state, jnp.asarray(tokens, jnp.int32)))


def embed(model, tokens: np.ndarray) -> jax.Array:
    """x₀ = embed(tokens) for one sequence: ``[T, E]`` float32."""
    toks = jnp.asarray(tokens, jnp.int32)[None]
    return model.embed(toks)[0].astype(jnp.float32)


def check_tokens(tokens: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Token ids as int32 ``[T]``, checked against the model's vocabulary and context."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"expected a non-empty 1-D token sequence, got shape {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), "
                         f"got [{tokens.min()}, {tokens.max()}]")
    if tokens.size > config.max_seq_len:
        raise ValueError(f"text has {tokens.size} tokens, more than the model's "
                         f"max_seq_len={config.max_seq_len}")
    return tokens.astype(np.int32)


def model_spectra(model, ts=None, mlp_units: np.ndarray | None = None, label: str = ""):
    """Spectra of an ODE model at times ``ts`` (default 101 points), or per layer of a baseline."""
    from ode_lm.analysis.spectra import spectra_from_weights

    if not is_ode(model):
        return spectra_from_weights(layer_canonical_weights(model), np.arange(num_layers(model)),
                                    "layer", mlp_units, label or model.config.architecture)
    ts = np.linspace(0.0, 1.0, 101) if ts is None else np.asarray(ts, np.float64)
    if ts.ndim != 1 or ts.size == 0 or ts.min() < 0 or ts.max() > 1:
        raise ValueError(f"--times: expected values in [0, 1], got {np.asarray(ts).tolist()}")
    parts = [spectra_from_weights(w, tc, "t", mlp_units) for tc, w in ode_weights_at(model, ts)]
    first = parts[0]
    return type(first)(
        depth=ts, depth_kind="t",
        qk=np.concatenate([p.qk for p in parts]), ov=np.concatenate([p.ov for p in parts]),
        mlp=np.concatenate([p.mlp for p in parts]), mlp_units=mlp_units,
        label=label or f"ode ({model.config.flavour})",
    )


def model_lyapunov(model, tokens: np.ndarray, *, position: int = -1, num_steps: int | None = None,
                   solver: str | None = None, num_exponents: int | None = None,
                   chunk_size: int | None = 64):
    """Token Lyapunov spectra of the model's prediction at ``position`` (see lyapunov.py).

    Discrete baselines are treated as the piecewise-constant field of ``discrete_field``
    integrated by Euler with one step per layer, which is exactly their forward pass.
    """
    from ode_lm.analysis.lyapunov import lyapunov_exponents

    cfg = model.config
    tokens = check_tokens(tokens, cfg)
    positions = jnp.arange(len(tokens), dtype=jnp.int32)
    if is_ode(model):
        field, args = ode_field(model)
        split = ode_split(model)
        num_steps = cfg.num_steps if num_steps is None else int(num_steps)
        solver = cfg.solver if solver is None else solver
    else:
        layers = num_layers(model)
        if num_steps not in (None, layers) or solver not in (None, "euler"):
            raise ValueError(f"--num_steps={num_steps} / --solver={solver}: a discrete "
                             f"{cfg.architecture} model has exactly {layers} layers (Euler)")
        field, args = discrete_field(model)
        split = None
        num_steps, solver = layers, "euler"
    res = lyapunov_exponents(field, embed(model, tokens), position=position,
                             num_steps=num_steps, solver=solver, num_exponents=num_exponents,
                             chunk_size=chunk_size, field_args=(*args, positions),
                             split=split)
    res.tokens = tokens
    return res
