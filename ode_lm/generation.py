"""Autoregressive text generation with a KV cache per ODE solver evaluation.

Why one cache slot per (step, stage): a solver step evaluates the vector field f at
``stages`` states (Euler 1: x_k; midpoint 2: x_k and x_k + dt/2·k1; RK4 4: x_k, x_k + dt/2·k1,
x_k + dt/2·k2, x_k + dt·k3), each at its own time with its own generated weights W(t). The
attention inside each evaluation sees keys/values projected from *that* state, so a step
with S stages needs S independent caches; M steps need M·S. The cache is therefore
``[M, S, B, T_max, H, Dh]`` for keys and values: exactly the KV cache of an M·S-layer
transformer. A materialised (discrete, parallel-block) model is the special case M = L
layers, S = 1, dt = 1 (its output projections already hold dt).

All weights W(t_{k,s}) are generated once per ``generate`` call, outside the token loop.

Adaptive solvers (``solver='adaptive'`` / ``'dopri5'``) recompute instead of caching: the
controller picks its own evaluation times for every forward (they depend on the state), so
earlier tokens' keys/values at the new times were never computed and a cache has nothing to
reuse. Each new token runs the full forward over a fixed [B, P + max_new_tokens] buffer
(causal attention keeps the unused tail out of earlier positions; one compile).
Prompts are left-padded into one batch; padding keys are masked and positions count real
tokens only, which is what the model sees for an unpadded prompt. The whole of ``generate``
(prefill + decode loop) is one ``jax.jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ode_lm.errors import UsageError
from ode_lm.models import solvers
from ode_lm.models.common import compute_dtype
from ode_lm.models.config import ModelConfig
from ode_lm.models.solve import Solve
from ode_lm.models.vector_field import KVCache, VectorField


def check_num_steps(num_steps: int | None, flag: str = "--num_steps") -> None:
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps <= 0):
        raise UsageError(f"{flag}={num_steps!r}: must be a positive number of solver steps")


# ----------------------------------------------------------------------------- the program


def stage_weights(model: nnx.Module, num_steps: int, solver: str):
    """(weights stacked [M, S, ...], dt, solver) the cached forward runs.

    DiffEqFormer: W(t) at every evaluation time of the solver. Discrete parallel-block
    models: their layer weights as M = L Euler steps with dt = 1.
    """
    from ode_lm.models.lm import DiffEqFormer

    if isinstance(model, DiffEqFormer):
        grid = solvers.FixedGrid(num_steps)
        return jax.vmap(jax.vmap(model.weights_at))(grid.times(solver)), grid.dt, solver
    blocks = getattr(model, "blocks", None)
    if blocks is None or model.config.architecture != "parallel":
        raise TypeError(
            f"generation: {type(model).__name__} ({model.config.architecture}) is not supported; "
            "use a DiffEqFormer or a materialised parallel-block model"
        )
    return jax.tree.map(lambda a: a[:, None], blocks.stacked()), 1.0, "euler"


def init_cache(config: ModelConfig, num_steps: int, stages: int, batch: int, max_len: int):
    shape = (num_steps, stages, batch, max_len, config.num_heads, config.head_dim)
    zeros = jnp.zeros(shape, compute_dtype(config))
    return {"k": zeros, "v": zeros}


def solve_cached(config, weights, dt, solver, x, positions, index, cache, key_valid):
    """One pass of T_new tokens through every solver step, updating each stage's cache slot.

    Each stage evaluates the model's one vector field (``VectorField.with_cache``) at its
    pre-generated weights."""
    field = VectorField(config, positions)

    def step(x, xs):
        w, ck, cv = xs  # w: [S, ...]; ck, cv: [S, B, T_max, H, Dh]
        cks, cvs = [], []

        def f(state, t, s):  # stage s: its weights (W(t) already: t unused) and cache slot
            ws = jax.tree.map(lambda a: a[s], w)
            out, kv = field.with_cache(state, t, KVCache(ck[s], cv[s], index, key_valid),
                                       weights=ws)
            cks.append(kv.k)
            cvs.append(kv.v)
            return out

        x_new, _ = solvers.rk_step(f, x, None, dt, solvers.tableau(solver),
                                   time_fn=lambda c: c)
        return x_new, (jnp.stack(cks), jnp.stack(cvs))

    x, (ck, cv) = jax.lax.scan(step, x, (weights, cache["k"], cache["v"]))
    return x, {"k": ck, "v": cv}


# ----------------------------------------------------------------------------- sampling


def sample_token(logits, key, temperature: float, top_p: float, vocab_limit: int | None):
    """Greedy for temperature <= 0, else temperature + nucleus (top-p) sampling. [B, V] → [B]."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0,
             min_width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, P], valid [B, P]) with every prompt right-aligned; P >= ``min_width`` (a
    caller that buckets prompt widths compiles once per bucket, not once per width)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    width = max(min_width, max(len(p) for p in prompts))
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    valid = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
        valid[i, width - len(p):] = True
    return tokens, valid


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "max_new_tokens", "num_steps", "solver", "temperature", "top_p", "vocab_limit"))
def _generate(graphdef, state, tokens, valid, key, *, max_new_tokens, num_steps, solver,
              temperature, top_p, vocab_limit):
    model = nnx.merge(graphdef, state)
    config = model.config
    weights, dt, solver = stage_weights(model, num_steps, solver)
    m, s = jax.tree.leaves(weights)[0].shape[:2]
    b, p = tokens.shape
    t_max = p + max_new_tokens
    cache = init_cache(config, m, s, b, t_max)
    key_valid = jnp.zeros((b, t_max), bool).at[:, :p].set(valid)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)

    x = model.embed(tokens, positions)
    x, cache = solve_cached(config, weights, dt, solver, x, positions, 0, cache, key_valid)
    key, sub = jax.random.split(key)
    first = sample_token(model.logits(x[:, -1:])[:, 0], sub, temperature, top_p, vocab_limit)
    last_pos = positions[:, -1]

    def body(i, carry):
        out, cache, key_valid, key = carry
        tok = out[:, i - 1][:, None]
        pos = (last_pos + i)[:, None]
        index = p + i - 1
        key_valid = key_valid.at[:, index].set(True)
        x = model.embed(tok, pos)
        x, cache = solve_cached(config, weights, dt, solver, x, pos, index, cache, key_valid)
        key, sub = jax.random.split(key)
        nxt = sample_token(model.logits(x)[:, 0], sub, temperature, top_p, vocab_limit)
        return out.at[:, i].set(nxt), cache, key_valid, key

    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    out, *_ = jax.lax.fori_loop(1, max_new_tokens, body, (out, cache, key_valid, key))
    return out


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "max_new_tokens", "solver", "rtol", "atol", "temperature", "top_p",
    "vocab_limit"))
def _generate_recompute(graphdef, state, tokens, valid, key, *, max_new_tokens, solver, rtol,
                        atol, temperature, top_p, vocab_limit):
    """Decoding without a cache (adaptive solvers): one full forward per new token."""
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    buf = jnp.zeros((b, p + max_new_tokens), jnp.int32).at[:, :p].set(tokens)
    real = jnp.ones((b, p + max_new_tokens), bool).at[:, :p].set(valid)
    segment_ids = real.astype(jnp.int32)  # left padding = segment 0, never attended to
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0).astype(jnp.int32)

    def body(i, carry):
        buf, key = carry
        logits = model(buf, positions, segment_ids,
                       solve=Solve(solver, rtol=rtol, atol=atol))
        key, sub = jax.random.split(key)
        last = jax.lax.dynamic_index_in_dim(logits, p + i - 1, axis=1, keepdims=False)
        nxt = sample_token(last, sub, temperature, top_p, vocab_limit)
        return jax.lax.dynamic_update_index_in_dim(buf, nxt, p + i, axis=1), key

    buf, _ = jax.lax.fori_loop(0, max_new_tokens, body, (buf, key))
    return buf[:, p:]


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    num_steps: int | None = None,
    solver: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    vocab_limit: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    min_width: int = 0,
) -> np.ndarray:
    """New tokens [B, max_new_tokens] for a batch of token-id prompts (jitted; KV-cached for
    fixed-grid solvers, recomputed for adaptive ones at ``rtol``/``atol``). Prompts are
    left-padded to at least ``min_width`` tokens (padding never changes the output)."""
    check_num_steps(num_steps)
    if max_new_tokens <= 0:
        raise UsageError(f"--max_new_tokens={max_new_tokens}: must be >= 1")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"--top_p={top_p}: must be in (0, 1]")
    if not temperature >= 0.0:  # NaN too
        raise UsageError(f"--temperature={temperature}: must be >= 0 (0 = greedy)")
    config = model.config
    num_steps = config.num_steps if num_steps is None else num_steps
    solver = config.solver if solver is None else solver
    solvers.check_solver(solver, adaptive_ok=True)
    tokens, valid = left_pad(prompts, min_width=min_width)
    width, limit = tokens.shape[1], config.max_seq_len
    if width + max_new_tokens > limit and config.flavour == "gpt2":
        if width >= limit:  # the prompt alone: no --max_new_tokens would fit
            raise UsageError(f"--prompt: {width} tokens, but the model learned {limit} "
                             f"positions (max_seq_len) and needs room for a new token: "
                             f"shorten it to at most {limit - 1} tokens")
        raise UsageError(
            f"--max_new_tokens={max_new_tokens}: the prompt ({width}) + max_new_tokens "
            f"exceeds the learned positions (max_seq_len={limit}): at most {limit - width} "
            "new tokens fit")
    graphdef, state = nnx.split(model)
    if solvers.is_adaptive(solver):
        if config.architecture != "ode":
            raise ValueError(f"--solver={solver}: adaptive solvers need an ODE model, not "
                             f"architecture={config.architecture!r}")
        out = _generate_recompute(
            graphdef, state, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(seed),
            max_new_tokens=max_new_tokens, solver=solver,
            rtol=config.rtol if rtol is None else float(rtol),
            atol=config.atol if atol is None else float(atol), temperature=float(temperature),
            top_p=float(top_p), vocab_limit=vocab_limit)
        return np.asarray(out)
    out = _generate(graphdef, state, jnp.asarray(tokens), jnp.asarray(valid),
                    jax.random.key(seed), max_new_tokens=max_new_tokens, num_steps=num_steps,
                    solver=solver, temperature=float(temperature), top_p=float(top_p),
                    vocab_limit=vocab_limit)
    return np.asarray(out)
