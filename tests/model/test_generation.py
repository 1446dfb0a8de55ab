"""KV-cached generation: exactly the tokens of uncached greedy decoding, for every solver."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import LIVELY, greedy_uncached, tiny_model

from ode_lm.generation import generate, left_pad, sample_token


def tiny(flavour: str, **kw) -> nnx.Module:
    return tiny_model(LIVELY, flavour=flavour, vocab_size=61, **kw)


@pytest.mark.parametrize("flavour,solver,steps", [
    ("gpt2", "euler", 3), ("llama", "midpoint", 2), ("neox", "rk4", 2)])
@pytest.mark.slow
def test_cached_equals_uncached_greedy(flavour, solver, steps):
    model = tiny(flavour)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]  # different lengths: left padding must not leak
    out = generate(model, prompts, max_new_tokens=6, num_steps=steps, solver=solver)
    assert out.shape == (2, 6)
    for row, prompt in zip(out, prompts, strict=True):
        ref = greedy_uncached(model, prompt, 6, num_steps=steps, solver=solver)
        np.testing.assert_array_equal(row, ref)


@pytest.mark.slow
def test_materialised_model_cached_equals_uncached():
    from ode_lm.models.materialize import materialize

    pm = materialize(tiny("llama"), 3)
    out = generate(pm, [[3, 1, 4, 1, 5]], max_new_tokens=5)
    np.testing.assert_array_equal(out[0], greedy_uncached(pm, [3, 1, 4, 1, 5], 5))


def test_sampling_is_seeded_and_top_p_limits_support():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 64))
    import jax

    keys = jax.random.split(jax.random.key(0), 2)
    a = sample_token(logits, keys[0], 1.0, 1.0, None)
    b = sample_token(logits, keys[0], 1.0, 1.0, None)
    np.testing.assert_array_equal(a, b)
    nucleus = sample_token(logits, keys[1], 1.0, 0.7, None)  # keeps tokens 0 and 1 only
    assert set(np.asarray(nucleus).tolist()) <= {0, 1}
    assert set(np.asarray(sample_token(logits, keys[1], 0.0, 1.0, 2)).tolist()) == {0}
    limited = sample_token(jnp.array([[0.0, 0.0, 9.0]]), keys[1], 0.0, 1.0, 2)
    assert int(limited[0]) in (0, 1)  # padded-vocab ids are never produced


def test_bad_inputs():
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="--num_steps=0"):
        generate(model, [[1]], num_steps=0)
    with pytest.raises(ValueError, match="--num_steps=-2"):
        generate(model, [[1]], num_steps=-2)
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []])
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1, 2]], max_new_tokens=40)
