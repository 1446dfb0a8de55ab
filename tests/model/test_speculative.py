"""Self-speculative decoding: greedy output is plain greedy decoding's at the verifier's solve
(every k, draft N, and rollback length, a draft that is always rejected included), and the
sampling rule's output is distributed as the verifier's distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import LIVELY, tiny_model

from ode_lm.errors import UsageError
from ode_lm.generation import generate
from ode_lm.speculative import (
    accept,
    choose_draft,
    forward_seconds,
    parse_solve,
    predicted_speedup,
    speculative_generate,
)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [11, 3, 9]]  # different lengths: per-row acceptance


@pytest.fixture(scope="module")
def model():
    return tiny_model(LIVELY, vocab_size=61, num_steps=4)


@pytest.fixture(scope="module")
def plain(model):
    return generate(model, PROMPTS, max_new_tokens=10, num_steps=4, solver="euler")


@pytest.mark.parametrize("k, draft", [(1, 1), (3, 2), (4, 1), (2, 3)])
def test_greedy_is_plain_greedy_at_the_verifier(model, plain, k, draft):
    out, stats = speculative_generate(model, PROMPTS, draft=(draft, "euler"),
                                      verify=(4, "euler"), draft_tokens=k, max_new_tokens=10)
    np.testing.assert_array_equal(out, plain)
    assert 0.0 <= stats.acceptance_rate <= 1.0
    assert 1.0 <= stats.tokens_per_round <= k + 1
    assert (stats.rounds >= np.ceil((10 - 1) / (k + 1))).all()  # k+1 tokens a round at most


def test_greedy_keeps_to_the_tokenizers_vocabulary(model):
    """A padded model vocabulary: the verifier's argmax, like plain decoding's, never picks
    a token past the tokenizer's (the sample CLI's ``vocab_limit``)."""
    limit = 23
    ref = generate(model, PROMPTS, max_new_tokens=10, num_steps=4, solver="euler",
                   vocab_limit=limit)
    out, _ = speculative_generate(model, PROMPTS, draft=(1, "euler"), verify=(4, "euler"),
                                  draft_tokens=3, max_new_tokens=10, vocab_limit=limit)
    np.testing.assert_array_equal(out, ref)
    assert out.max() < limit


def test_one_prompt_runs_without_the_batch_map(model):
    ref = generate(model, PROMPTS[:1], max_new_tokens=8, num_steps=4, solver="euler")
    for cap in (None, 0):
        out, _ = speculative_generate(model, PROMPTS[:1], draft=(2, "euler"),
                                      verify=(4, "euler"), draft_tokens=3, max_new_tokens=8,
                                      accept_cap=cap)
        np.testing.assert_array_equal(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [0, 1, 2, 3])
def test_every_rollback_length_gives_the_same_tokens(model, plain, cap):
    """Accepting at most ``cap`` proposals a round rolls both caches back at that length
    (0: a draft that is always rejected, one token a round)."""
    out, stats = speculative_generate(model, PROMPTS, draft=(2, "euler"), verify=(4, "euler"),
                                      draft_tokens=3, max_new_tokens=10, accept_cap=cap)
    np.testing.assert_array_equal(out, plain)
    assert (stats.accepted <= cap * stats.rounds).all()
    if cap == 0:
        assert stats.acceptance_rate == 0.0 and (stats.rounds == 9).all()


@pytest.mark.slow
def test_a_verifier_with_another_solver(model):
    ref = generate(model, PROMPTS, max_new_tokens=6, num_steps=2, solver="rk4")
    out, _ = speculative_generate(model, PROMPTS, draft=(1, "euler"), verify=(2, "rk4"),
                                  draft_tokens=2, max_new_tokens=6)
    np.testing.assert_array_equal(out, ref)


def test_greedy_acceptance_counts():
    draft = jnp.array([2, 0, 1])
    target = jnp.array([2, 0, 3, 1])  # the verifier's argmax at each of the k + 1 positions
    p = jax.nn.one_hot(target, 4) * 5.0
    a, c = accept(draft, None, p, jax.random.key(0), 0.0)
    assert (int(a), int(c)) == (2, 3)  # d1, d2 accepted; d3 replaced by the verifier's 3
    a, c = accept(jnp.array([2, 0, 3]), None, p, jax.random.key(0), 0.0)
    assert (int(a), int(c)) == (3, 1)  # all accepted, the bonus token follows


def test_sampling_rule_gives_the_verifiers_distribution():
    """Draws d ~ q, accepted by min(1, p/q), else a draw from norm(max(0, p - q)): the first
    token must be distributed as p₀, the second (given the first was accepted) as p₁."""
    q = jnp.array([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    p = jnp.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3], [0.25, 0.25, 0.25, 0.25]])
    n = 40_000

    def one(key):
        k_d, k_a = jax.random.split(key)
        d = jax.random.categorical(k_d, jnp.log(q), axis=-1).astype(jnp.int32)
        a, c = accept(d, q, p, k_a, 1.0)
        first = jnp.where(a >= 1, d[0], c)
        second = jnp.where(a >= 2, d[1], c)
        return first, second, a

    first, second, a = (np.asarray(x) for x in jax.vmap(one)(jax.random.split(
        jax.random.key(0), n)))
    for tokens, want in ((first, p[0]), (second[a >= 1], p[1])):
        freq = np.bincount(tokens, minlength=4) / len(tokens)
        sigma = np.sqrt(np.asarray(want) * (1 - np.asarray(want)) / len(tokens))
        assert np.all(np.abs(freq - want) < 5 * sigma), (freq, want)  # 5σ: a flake in 1e6


def test_bad_inputs(model):
    with pytest.raises(UsageError, match="--draft=adaptive:2"):
        parse_solve("adaptive:2", "--draft")
    with pytest.raises(UsageError, match="--draft=euler: expected SOLVER:STEPS"):
        parse_solve("euler", "--draft")
    assert parse_solve("rk4:3", "--draft") == (3, "rk4")
    with pytest.raises(UsageError, match="--draft_tokens=0"):
        speculative_generate(model, PROMPTS, draft=(1, "euler"), draft_tokens=0)


def test_predicted_speedup_counts_the_rounds_real_cost():
    # α = 0.5, k = 2: (1 − 0.5³)/(1 − 0.5) = 1.75 tokens per round; the round costs a draft
    # forward of 2 positions (2), one of 1 (1) and the verifier's of 3 (3): 6, plain 2/token
    assert predicted_speedup(0.5, 2, (1.0, 2.0), 3.0, 2.0) == pytest.approx(1.75 * 2 / 6)
    assert predicted_speedup(1.0, 3, (0.0, 0.0), 1.0, 1.0) == pytest.approx(4.0)


def test_auto_picks_the_fastest_draft_or_plain_decoding():
    cheap = {1: (0.1, 0.15), 2: (0.2, 0.3)}
    verify = {k: 1.0 + 0.1 * k for k in range(2, 9)}
    good = choose_draft({1: 0.2, 2: 0.9}, cheap, verify, 1.0)
    assert good.draft == (2, "euler") and good.speedup > 1.0
    assert good.speedup == pytest.approx(max(
        predicted_speedup(a, k, cheap[n], verify[k], 1.0)
        for n, a in {1: 0.2, 2: 0.9}.items() for k in verify))
    assert "euler:2 x" in good.text()
    assert good.text().splitlines()[1] == (
        "--draft=auto: a forward, ms (compiled): the verifier at 1 position 1000.00, at k + 1 "
        "= 3: 1200.00, 4: 1300.00, 5: 1400.00, 6: 1500.00, 7: 1600.00, 8: 1700.00, 9: 1800.00; "
        "an Euler draft step N=1: 100.00, N=2: 200.00")
    hopeless = choose_draft({1: 0.0, 2: 0.1}, cheap, verify, 1.0)  # drafts always rejected
    assert hopeless.draft is None and hopeless.speedup < 1.0
    assert hopeless.text().startswith("--draft=auto: plain decoding (no draft predicted faster")


def test_forward_seconds_times_a_compiled_forward(model):
    seconds = forward_seconds(model, [((2, "euler"), 1), ((4, "euler"), 3)], repeats=2,
                              rounds=1)
    assert len(seconds) == 2 and all(0.0 < s < 60.0 for s in seconds)
