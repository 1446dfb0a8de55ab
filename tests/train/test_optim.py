"""Optimizer chain: schedule shape, weight-decay masks (paper preset, regex, predicate), clip."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ode_lm.training import optim

PARAMS = {
    "embeddings": {"token": jnp.ones((8, 4)), "position": jnp.ones((4, 4))},
    "block": {"qkv": {"w0": jnp.ones((4, 12)), "a": jnp.ones((2, 4, 12)), "f_b": jnp.ones((2, 12))},
              "norm1": {"f_w": jnp.ones((2, 4))}},
    "head": {"norm_scale": jnp.ones((4,)), "bias": jnp.ones((4,))},
}


def test_schedule_warmup_then_cosine_to_min_ratio():
    cfg = optim.OptimizerConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    s = optim.learning_rate_schedule(cfg, 100)
    assert float(s(0)) == 0.0
    assert float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(100)) == pytest.approx(0.1)
    assert 0.1 < float(s(55)) < 1.0
    values = [float(s(i)) for i in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_paper_mask_decays_matrices_but_not_embeddings_norms_biases():
    mask = optim.weight_decay_mask(PARAMS, "paper")
    assert mask["block"]["qkv"]["w0"] and mask["block"]["qkv"]["a"]
    assert mask["block"]["qkv"]["f_b"]  # a 2-D hypernetwork coefficient of a bias
    assert not mask["embeddings"]["token"] and not mask["embeddings"]["position"]
    assert not mask["block"]["norm1"]["f_w"]
    assert not mask["head"]["norm_scale"] and not mask["head"]["bias"]


def test_regex_and_predicate_masks():
    mask = optim.weight_decay_mask(PARAMS, r"qkv/(w0|a)$")
    assert mask["block"]["qkv"]["w0"] and mask["block"]["qkv"]["a"]
    assert not mask["block"]["qkv"]["f_b"] and not mask["embeddings"]["token"]
    mask = optim.weight_decay_mask(PARAMS, lambda path, x: path.startswith("head"))
    assert mask["head"]["bias"] and not mask["block"]["qkv"]["w0"]
    assert not any(np.asarray(list(optim.weight_decay_mask({"a": jnp.ones(3)}, "none").values())))
    with pytest.raises(ValueError, match="is not a regex"):
        optim.weight_decay_mask(PARAMS, "(unclosed")


def test_adamw_applies_decay_only_where_masked_and_clips():
    cfg = optim.OptimizerConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5,
                                weight_decay_mask=r"^w$", clip_norm=1.0, min_lr_ratio=1.0)
    tx, _ = optim.make_optimizer(cfg, 10)
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2, 2))}
    zero = {"w": jnp.zeros((2, 2)), "b": jnp.zeros((2, 2))}
    updates, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
    np.testing.assert_allclose(updates["b"], 0.0)
    clip = optax.clip_by_global_norm(1.0)
    huge = {"w": jnp.full((2, 2), 100.0), "b": jnp.zeros((2, 2))}
    clipped, _ = clip.update(huge, clip.init(params))
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0, rel=1e-5)


def test_bad_optimizer_config():
    with pytest.raises(ValueError, match="min_lr_ratio=2"):
        optim.OptimizerConfig(min_lr_ratio=2)
    with pytest.raises(ValueError, match="learning_rate=0"):
        optim.OptimizerConfig(learning_rate=0)
