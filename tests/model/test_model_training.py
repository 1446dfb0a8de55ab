"""Trainability: init (jax.random), gradients, init scale, initial loss, bf16, remat, random
grid offset."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import TINY, tiny_config, tiny_model
from numerics import f32_atol

from ode_lm.models import build_model, weights_at
from ode_lm.models.common import normal_init

THREE = dict(TINY, num_steps=3)


def loss_fn(model, x, **kw):
    logits = model(x[:, :-1], **kw)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1).mean()


def flat_grads(model, x, **kw):
    grads = nnx.grad(loss_fn)(model, x, **kw)
    return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)}


def tokens(b=2, t=13, seed=0, vocab=64):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.slow
def test_gradients_finite_and_nonzero_for_every_hypernetwork_param(flavour):
    model = tiny_model(THREE, flavour=flavour)
    g = flat_grads(model, tokens())
    assert all(np.isfinite(v).all() for v in g.values())
    hyper = {k: v for k, v in g.items() if k.startswith("block/")}
    # At init the norms' F factors are zero, so their time MLPs get exactly zero gradient
    # (gain(t) = 1 + g(t)·F); every other hypernetwork parameter must already learn.
    frozen = {k for k in hyper if k.startswith(("block/norm1/time_mlp", "block/norm2/time_mlp"))}
    for k, v in hyper.items():
        if k in frozen:
            assert np.abs(v).max() == 0.0, k
        else:
            assert np.abs(v).max() > 0.0, k
    # one SGD step makes F non-zero, after which every hypernetwork parameter has a gradient
    params = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(params):
        key = "/".join(map(str, path))
        var[...] = var[...] - 1.0 * g[key]
    g2 = flat_grads(model, tokens(seed=1))
    for k in hyper:
        assert np.abs(g2[k]).max() > 0.0, k


def test_normal_init_is_jax_random_normal():
    # the flat draw + reshape must be exactly flax's initializer (row-major order included),
    # and a model's parameters must come from its Rngs' params stream
    key = jax.random.key(3)
    ours = np.asarray(normal_init(0.02)(key, (6, 7)))
    np.testing.assert_array_equal(ours, np.asarray(nnx.initializers.normal(0.02)(key, (6, 7))))
    a = tiny_model(THREE).embeddings.token[...]
    b = build_model(tiny_config(THREE), nnx.Rngs(params=0)).embeddings.token[...]
    c = build_model(tiny_config(THREE), nnx.Rngs(1)).embeddings.token[...]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.slow
def test_generated_weights_have_baseline_init_scale_at_every_t():
    cfg = tiny_config(THREE, d_model=64, time_embed_dim=8, sinusoidal_dim=16)
    model = build_model(cfg, nnx.Rngs(0))
    ts = jnp.linspace(0.0, 1.0, 11)
    ws = jax.vmap(lambda t: weights_at(model, t))(ts)
    for name in ("qkv_kernel", "out_kernel", "mlp_in_kernel", "mlp_out_kernel"):
        stds = np.asarray(ws[name].reshape(len(ts), -1).std(axis=1))
        ratio = stds / cfg.init_std
        assert (ratio > 0.5).all() and (ratio < 2.0).all(), (name, ratio)
    # gain(t) = 1 at init, exactly: the gain's time MLP has a zero-initialised output layer
    np.testing.assert_allclose(np.asarray(ws["norm1_scale"]), 1.0, rtol=0, atol=0)


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "neox"])
def test_initial_loss_is_about_ln_vocab(flavour):
    cfg = tiny_config(THREE, flavour=flavour, vocab_size=512)
    model = build_model(cfg, nnx.Rngs(1))
    loss = float(loss_fn(model, tokens(b=4, t=17, vocab=512)))
    assert abs(loss - math.log(512)) < 0.1 * math.log(512), loss


def test_bf16_forward_close_to_fp32():
    model = tiny_model(THREE)
    x = tokens()
    y32 = np.asarray(model(x))
    model16 = nnx.merge(nnx.graphdef(build_model(tiny_config(THREE, dtype="bfloat16"),
                                                 nnx.Rngs(0))), nnx.state(model))
    y16 = model16(x)
    assert y16.dtype == jnp.float32
    err = np.abs(np.asarray(y16) - y32).max() / np.abs(y32).max()
    assert err < 0.05, err


@pytest.mark.slow
def test_precompute_and_remat_policies_match_in_scan():
    base = tiny_config(THREE, weight_generation="in_scan")
    model = build_model(base, nnx.Rngs(0))
    x = tokens()
    ref = flat_grads(model, x)
    state = nnx.state(model)
    for kw in ({"weight_generation": "precompute", "remat": "dots_saveable"},
               {"weight_generation": "precompute"}, {"weight_generation": "auto"},
               {"remat": "full"}):
        other = nnx.merge(nnx.graphdef(build_model(base.replace(**kw), nnx.Rngs(0))), state)
        g = flat_grads(other, x)
        # Same math, reassociated (precomputed vs in-scan W(t), recomputed activations): each
        # gradient entry is a float32 sum over B·T positions and solver steps, accurate to a
        # few ulps of the leaf's *largest* entries (small entries are cancellations, so a
        # relative bound means nothing for them). Measured: 3e-6 of the leaf max on x86.
        for k, v in ref.items():
            np.testing.assert_allclose(g[k], v, rtol=1e-4, atol=f32_atol(v, 512),
                                       err_msg=f"{kw} {k}")


def test_random_grid_offset_only_in_training_mode():
    cfg = tiny_config(THREE, random_grid_offset=True)
    model = build_model(cfg, nnx.Rngs(0))
    x = tokens()
    det = np.asarray(model(x))
    a = np.asarray(model(x, deterministic=False, rngs=nnx.Rngs(dropout=1)))
    b = np.asarray(model(x, deterministic=False, rngs=nnx.Rngs(dropout=2)))
    assert np.abs(a - det).max() > 0 and np.abs(a - b).max() > 0
    assert np.abs(a - det).max() < 0.5  # a shift of the grid, not a different model
    with pytest.raises(ValueError, match="rngs"):
        model(x, deterministic=False)
    plain = nnx.merge(nnx.graphdef(tiny_model(THREE)),
                      nnx.state(model))
    np.testing.assert_array_equal(np.asarray(plain(x, deterministic=False)), det)
