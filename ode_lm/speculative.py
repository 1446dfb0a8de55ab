"""Self-speculative decoding: the same weights draft at a cheap solve and verify at the full one.

A continuous-depth model is its own draft model: solved with few Euler steps it is a cheap
approximation of itself at its own N. Each round (Leviathan et al. 2023; Chen et al. 2023)

1. the draft solve proposes k tokens, one at a time, from its own KV cache;
2. the verifier solve scores the last accepted token and the k proposals in one forward
   (k + 1 positions) from its KV cache;
3. greedy: proposals are accepted while they equal the verifier's argmax, then the
   verifier's own token follows (a correction, or a bonus token when all k were accepted);
   sampling: proposal i is accepted with probability min(1, p(dᵢ)/q(dᵢ)), the first rejected
   one replaced by a draw from norm(max(0, p − q)), a bonus drawn from p when all pass. The
   output is the verifier's: greedy, the same tokens as plain decoding at its solve; sampled,
   the same distribution.
4. both caches roll back to the accepted prefix: keys past it are marked invalid and are
   overwritten by the next round (the draft re-feeds the token before the last one, so its
   cache never misses a position the verifier accepted).

Rows accept different numbers of tokens, so one row is written as a scalar program and
``jax.vmap`` runs the batch: per-row cache indices, per-row acceptance, one jit, fixed shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ode_lm.errors import UsageError
from ode_lm.generation import init_cache, left_pad, solve_cached, stage_weights
from ode_lm.models.config import SOLVERS


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """Per prompt: verifier rounds and draft tokens accepted."""

    rounds: np.ndarray  # [B]
    accepted: np.ndarray  # [B]
    draft_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens, over the batch."""
        return float(self.accepted.sum() / max(1, self.rounds.sum() * self.draft_tokens))

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens each verifier forward produced (accepted drafts + its own token)."""
        return float((self.accepted.sum() + self.rounds.sum()) / max(1, self.rounds.sum()))


def distribution(logits, temperature: float, top_p: float, vocab_limit: int | None):
    """The sampling distribution ``generation.sample_token`` draws from, as probabilities."""
    logits = _limited(logits, vocab_limit) / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = jnp.take_along_axis(sorted_logits, jnp.argsort(order, axis=-1), axis=-1)
    return jax.nn.softmax(logits, axis=-1)


def _limited(logits, vocab_limit):
    """float32 logits, -inf past the tokenizer's vocabulary (the model's may be padded)."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    return logits


def _greedy(logits, vocab_limit):
    return jnp.argmax(_limited(logits, vocab_limit), axis=-1).astype(jnp.int32)


def accept(draft, q, p, key, temperature: float):
    """(accepted count a, the verifier's token after them) for one row.

    draft [k] tokens, q [k, V] the draft's distributions they were drawn from (unused when
    greedy), p [k + 1, V] the verifier's distributions (greedy: its logits) at the last
    accepted token and after each proposal."""
    k = draft.shape[0]
    if temperature <= 0:
        target = jnp.argmax(p, axis=-1).astype(jnp.int32)
        ok = draft == target[:k]
        a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
        return a, target[a]
    k_u, k_c = jax.random.split(key)
    rows = jnp.arange(k)
    ratio = p[rows, draft] / jnp.maximum(q[rows, draft], 1e-30)
    ok = jax.random.uniform(k_u, (k,)) < ratio
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:1])])  # after k accepted: draw from p
    residual = jnp.maximum(p[a] - q_pad[a], 0.0)
    residual = jnp.where(residual.sum() > 0, residual, p[a])  # p == q: any draw from p
    c = jax.random.categorical(k_c, jnp.log(residual / residual.sum()))
    return a, c.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "max_new_tokens", "draft", "verify", "k", "temperature", "top_p",
    "vocab_limit", "accept_cap"))
def _speculate(graphdef, state, tokens, valid, key, *, max_new_tokens, draft, verify, k,
               temperature, top_p, vocab_limit, accept_cap=None):
    model = nnx.merge(graphdef, state)
    config = model.config
    wd, dt_d, solver_d = stage_weights(model, *draft)
    wv, dt_v, solver_v = stage_weights(model, *verify)
    md, sd = jax.tree.leaves(wd)[0].shape[:2]
    mv, sv = jax.tree.leaves(wv)[0].shape[:2]
    _, p = tokens.shape
    total = max_new_tokens + k + 1  # room for the last round's overshoot
    t_max = p + total

    def dist(logits):
        if temperature <= 0:  # greedy: the logits the verifier's argmax reads, vocab limited
            return _limited(logits, vocab_limit)
        return distribution(logits, temperature, top_p, vocab_limit)

    def pick(logits, key):
        if temperature <= 0:
            return _greedy(logits, vocab_limit)
        return jax.random.categorical(
            key, jnp.log(distribution(logits, temperature, top_p, vocab_limit))).astype(jnp.int32)

    def one(row, row_valid, key):
        row, row_valid = row[None], row_valid[None]
        positions = jnp.maximum(jnp.cumsum(row_valid, axis=1) - 1, 0).astype(jnp.int32)
        base = positions[0, -1] - (p - 1)  # position of buffer index i: base + i
        key_valid = jnp.zeros((1, t_max), bool).at[:, :p].set(row_valid)
        x0 = model.embed(row, positions)
        _, cache_d = solve_cached(config, wd, dt_d, solver_d, x0, positions, 0,
                                  init_cache(config, md, sd, 1, t_max), key_valid)
        xv, cache_v = solve_cached(config, wv, dt_v, solver_v, x0, positions, 0,
                                   init_cache(config, mv, sv, 1, t_max), key_valid)
        key, sub = jax.random.split(key)
        first = pick(model.logits(xv[:, -1:])[0, 0], sub)
        out = jnp.zeros((total,), jnp.int32).at[0].set(first)
        prompt_last = row[0, -1]

        def round_(carry):
            out, g, cache_d, cache_v, key_valid, key, rounds, accepted = carry
            n = p + g  # buffer length; the last token (out[g-1]) sits at index n - 1
            idx = jnp.arange(t_max)
            key_valid = key_valid | ((idx >= p) & (idx < n + k))[None]
            last = out[g - 1]
            prev = jnp.where(g >= 2, out[jnp.maximum(g - 2, 0)], prompt_last)
            key, k_draft, k_acc = jax.random.split(key, 3)
            # the draft: re-feed the token before the last (its cache may lack it), then k - 1
            two = jnp.stack([prev, last])[None]
            pos2 = (base + n - 2 + jnp.arange(2))[None].astype(jnp.int32)
            x, cache_d = solve_cached(config, wd, dt_d, solver_d, model.embed(two, pos2), pos2,
                                      n - 2, cache_d, key_valid)
            logits = model.logits(x[:, -1:])[0, 0]
            d_keys = jax.random.split(k_draft, k)
            d0 = pick(logits, d_keys[0])

            def draft_step(c, j):
                tok, cache_d = c
                pos = (base + n - 1 + j)[None, None].astype(jnp.int32)
                x, cache_d = solve_cached(config, wd, dt_d, solver_d,
                                          model.embed(tok[None, None], pos), pos, n - 1 + j,
                                          cache_d, key_valid)
                lg = model.logits(x)[0, 0]
                nxt = pick(lg, d_keys[j])
                return (nxt, cache_d), (nxt, dist(lg))

            (_, cache_d), (rest, rest_q) = jax.lax.scan(draft_step, (d0, cache_d),
                                                        jnp.arange(1, k))
            drafts = jnp.concatenate([d0[None], rest])
            q = jnp.concatenate([dist(logits)[None], rest_q])
            # the verifier: the last token and the k proposals in one forward
            seq = jnp.concatenate([last[None], drafts])[None]
            pos = (base + n - 1 + jnp.arange(k + 1))[None].astype(jnp.int32)
            x, cache_v = solve_cached(config, wv, dt_v, solver_v, model.embed(seq, pos), pos,
                                      n - 1, cache_v, key_valid)
            scores = dist(model.logits(x)[0])
            a, c = accept(drafts, q, scores, k_acc, temperature)
            if accept_cap is not None:  # tests: roll back after exactly min(a, cap) tokens
                a = jnp.minimum(a, accept_cap)
                c = jnp.argmax(scores[a]).astype(jnp.int32)  # greedy only
            new = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)])
            slot = jnp.arange(k + 1)
            new = jnp.where(slot < a, new, jnp.where(slot == a, c, 0))
            out = jax.lax.dynamic_update_slice(out, new, (g,))
            # roll both caches back to the accepted prefix: last, d_1..d_a
            key_valid = jnp.where((idx >= p)[None], (idx < n + a)[None], key_valid)
            return (out, g + a + 1, cache_d, cache_v, key_valid, key, rounds + 1,
                    accepted + a)

        init = (out, jnp.int32(1), cache_d, cache_v, key_valid, key, jnp.int32(0), jnp.int32(0))
        out, _, _, _, _, _, rounds, accepted = jax.lax.while_loop(
            lambda c: c[1] < max_new_tokens, round_, init)
        return out[:max_new_tokens], rounds, accepted

    keys = jax.random.split(key, tokens.shape[0])
    if tokens.shape[0] == 1:  # one row: no batched loop condition, no selects on the caches
        return jax.tree.map(lambda a: a[None], one(tokens[0], valid[0], keys[0]))
    return jax.vmap(one)(tokens, valid, keys)


def parse_solve(text: str, flag: str) -> tuple[int, str]:
    """``euler:2`` / ``rk4:8`` / ``6`` (the model's solver) → (num_steps, solver)."""
    solver, _, steps = text.rpartition(":")
    try:
        n = int(steps)
    except ValueError:
        n = 0
    if n <= 0:
        raise UsageError(f"{flag}={text}: expected SOLVER:STEPS, e.g. euler:2")
    solver = solver or "euler"
    if solver not in SOLVERS:
        raise UsageError(f"{flag}={text}: a draft or verifier needs a fixed-grid solver "
                         f"({', '.join(SOLVERS)}), not {solver!r}")
    return n, solver


def speculative_generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    draft: tuple[int, str],
    verify: tuple[int, str] | None = None,
    draft_tokens: int = 4,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    vocab_limit: int | None = None,
    min_width: int = 0,
    accept_cap: int | None = None,
) -> tuple[np.ndarray, SpeculativeStats]:
    """(new tokens [B, max_new_tokens], stats): ``draft`` = (N, solver) proposes
    ``draft_tokens`` at a time, ``verify`` (default: the model's own solve) decides.
    ``accept_cap`` (greedy, for tests): accept at most that many proposals per round, so
    every rollback length can be exercised (0: a draft that is always rejected)."""
    config = model.config
    if config.architecture != "ode":
        raise UsageError(f"--draft: self-speculative decoding needs an ODE model, not "
                         f"architecture={config.architecture!r}")
    verify = verify or (config.num_steps, config.solver)
    if draft_tokens < 1:
        raise UsageError(f"--draft_tokens={draft_tokens}: must be >= 1")
    if max_new_tokens <= 0:
        raise UsageError(f"--max_new_tokens={max_new_tokens}: must be >= 1")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"--top_p={top_p}: must be in (0, 1]")
    if not temperature >= 0.0:
        raise UsageError(f"--temperature={temperature}: must be >= 0 (0 = greedy)")
    tokens, valid = left_pad(prompts, min_width=min_width)
    width = tokens.shape[1] + max_new_tokens + draft_tokens + 1
    if width > config.max_seq_len and config.flavour == "gpt2":
        raise UsageError(
            f"--max_new_tokens={max_new_tokens}: the prompt ({tokens.shape[1]}) + "
            f"max_new_tokens + draft_tokens + 1 exceeds the learned positions "
            f"(max_seq_len={config.max_seq_len})")
    graphdef, state = nnx.split(model)
    out, rounds, accepted = _speculate(
        graphdef, state, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(seed),
        max_new_tokens=max_new_tokens, draft=tuple(draft), verify=tuple(verify),
        k=draft_tokens, temperature=float(temperature), top_p=float(top_p),
        vocab_limit=vocab_limit, accept_cap=accept_cap)
    return np.asarray(out), SpeculativeStats(np.asarray(rounds), np.asarray(accepted),
                                             draft_tokens)


AUTO_DRAFT_STEPS = (1, 2, 3)
AUTO_DRAFT_TOKENS = tuple(range(2, 9))
AUTO_BATCHES = 2


@dataclasses.dataclass(frozen=True)
class DraftChoice:
    draft: tuple[int, str] | None  # None: no draft is predicted faster than plain decoding
    draft_tokens: int
    agreement: dict[int, float]  # draft N → greedy agreement with the verifier
    speedup: float  # predicted, from the agreement and the timed forwards
    draft_cost: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    verify_cost: dict[int, float] = dataclasses.field(default_factory=dict)  # k → seconds
    plain_cost: float = 0.0

    def text(self) -> str:
        """Two lines: the choice with its reasons, the timed forwards it rests on."""
        agree = ", ".join(f"N={n}: {100 * a:.0f}%" for n, a in self.agreement.items())
        said = (f"agreement with the verifier on validation text {agree}; predicted "
                f"{self.speedup:.2f}x from the timed forwards")
        if self.draft is None:
            line = f"--draft=auto: plain decoding (no draft predicted faster: {said})"
        else:
            line = f"--draft=auto: euler:{self.draft[0]} x {self.draft_tokens} ({said})"
        if not self.verify_cost:
            return line
        verify = ", ".join(f"{k + 1}: {1e3 * c:.2f}" for k, c in self.verify_cost.items())
        draft = ", ".join(f"N={n}: {1e3 * c[0]:.2f}" for n, c in self.draft_cost.items())
        return (f"{line}\n--draft=auto: a forward, ms (compiled): the verifier at 1 position "
                f"{1e3 * self.plain_cost:.2f}, at k + 1 = {verify}; an Euler draft step {draft}")


def predicted_speedup(agreement: float, k: int, draft_cost: tuple[float, float],
                      verify_cost: float, plain_cost: float) -> float:
    """Tokens per round, (1 − αᵏ⁺¹)/(1 − α) for per-token agreement α, over the round's
    cost (the draft's forwards: one of 2 positions, k − 1 of one; the verifier's forward
    of k + 1 positions) in plain decoding's cost per token (the verifier's forward of
    one position). ``draft_cost``: (seconds at 1 position, at 2)."""
    a = min(agreement, 1 - 1e-9)
    one, two = draft_cost
    return (1 - a ** (k + 1)) / (1 - a) * plain_cost / (two + (k - 1) * one + verify_cost)


def forward_seconds(model: nnx.Module, forwards: Sequence[tuple[tuple[int, str], int]],
                    repeats: int = 50, rounds: int = 5) -> list[float]:
    """Seconds of one compiled cached forward for each (solve, positions) of ``forwards``
    (a draft's step: 1 position; a verifier's round: k + 1; plain decoding: 1): the best
    of ``rounds`` timings of ``repeats`` calls, the forwards taken in turn each round so a
    slow spell of the host hits them alike. What a round costs here, not what its NFE
    suggest (on a small model a forward of k + 1 positions costs more than one of 1)."""
    import time

    config = model.config
    t_max = min(config.max_seq_len, 128)
    key_valid = jnp.ones((1, t_max), bool)
    calls = []
    for solve, positions in forwards:
        weights, dt, solver = stage_weights(model, *solve)
        m, st = jax.tree.leaves(weights)[0].shape[:2]
        at = t_max // 2 - positions

        @functools.partial(jax.jit, static_argnames=("at",))
        def forward(weights, cache, tokens, pos, *, at, dt=dt, solver=solver):
            x, cache = solve_cached(config, weights, dt, solver, model.embed(tokens, pos), pos,
                                    at, cache, key_valid)
            return jnp.argmax(model.logits(x), axis=-1), cache

        args = (weights, init_cache(config, m, st, 1, t_max),
                jnp.zeros((1, positions), jnp.int32),
                (at + jnp.arange(positions, dtype=jnp.int32))[None])
        jax.block_until_ready(forward(*args, at=at))
        calls.append(functools.partial(forward, *args, at=at))
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            for _ in range(repeats):
                out = call()
            jax.block_until_ready(out)
            best[i] = min(best[i], (time.perf_counter() - t0) / repeats)
    return best


def auto_draft(model: nnx.Module, data_config, verify: tuple[int, str],
               model_dir: str) -> DraftChoice:
    """The draft N (Euler) and k with the best predicted speed-up: greedy agreement of each
    draft solve with the verifier on the run's first validation batches (teacher forced),
    and each forward's cost timed here (compiled). None of them faster than plain
    decoding: the choice says so, and plain decoding it is."""
    from ode_lm import data as data_lib

    config = data_config  # the run's (a DataConfig), None when it records none
    if config is None:
        raise UsageError(f"--draft=auto: {model_dir} names no validation data")

    from ode_lm.models.solve import Solve

    @nnx.jit(static_argnames=("solve",))
    def argmax(m, batch, solve):
        logits = m(batch["inputs"], batch["positions"], batch["segment_ids"], solve=solve)
        return jnp.argmax(logits, axis=-1)

    same = dict.fromkeys(AUTO_DRAFT_STEPS, 0.0)
    count = 0.0
    for i, batch in enumerate(data_lib.make_eval_iterator(config)):
        if i == AUTO_BATCHES:
            break
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        mask = np.asarray(batch["loss_mask"]) > 0
        target = np.asarray(argmax(model, batch, Solve(verify[1], verify[0])))
        for n in AUTO_DRAFT_STEPS:
            guess = np.asarray(argmax(model, batch, Solve("euler", n)))
            same[n] += float(((guess == target) & mask).sum())
        count += float(mask.sum())
    agreement = {n: same[n] / max(count, 1.0) for n in AUTO_DRAFT_STEPS}
    drafts = [((n, "euler"), p) for n in AUTO_DRAFT_STEPS for p in (1, 2)]
    verifies = [(verify, k + 1) for k in AUTO_DRAFT_TOKENS]
    seconds = forward_seconds(model, [(verify, 1), *drafts, *verifies])
    plain_cost, seconds = seconds[0], seconds[1:]
    draft_cost = {n: (seconds[2 * i], seconds[2 * i + 1])
                  for i, n in enumerate(AUTO_DRAFT_STEPS)}
    verify_cost = dict(zip(AUTO_DRAFT_TOKENS, seconds[len(drafts):], strict=True))
    return choose_draft(agreement, draft_cost, verify_cost, plain_cost)


def choose_draft(agreement: dict[int, float], draft_cost: dict[int, tuple[float, float]],
                 verify_cost: dict[int, float], plain_cost: float) -> DraftChoice:
    """The (draft N, k) of the best predicted speed-up over every N of ``agreement`` and k
    of ``verify_cost``; no draft when none beats plain decoding."""
    best = max((predicted_speedup(agreement[n], k, draft_cost[n], verify_cost[k], plain_cost),
                n, k) for n in agreement for k in verify_cost)
    draft = (best[1], "euler") if best[0] > 1.0 else None
    return DraftChoice(draft, best[2], agreement, best[0], draft_cost, verify_cost, plain_cost)
