"""Sharded equals unsharded: 5 fp32 train steps of the real DiffEqFormer on several meshes
give the same losses as one device (to 1e-5), with grad accumulation and the NaN guard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import f32_atol

from ode_lm import partitioning as pt
from ode_lm.models import build_model
from ode_lm.models.config import ModelConfig
from ode_lm.training import optim
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib

CONFIG = ModelConfig(vocab_size=128, d_model=32, num_heads=4, num_steps=2, max_seq_len=16,
                     time_embed_dim=4, sinusoidal_dim=4, dtype="float32")
BATCH, SEQ, STEPS = 8, 16, 5


def batches(n: int = STEPS) -> list[dict[str, np.ndarray]]:
    """Counting rows from a random start (next token = token + 1 mod V: learnable, so five
    steps lower the loss; uniformly random tokens cannot go below log V and only test noise),
    two documents per row (segment ids, restarting positions), some targets masked."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        start = rng.integers(0, CONFIG.vocab_size, (BATCH, 1))
        toks = (start + np.arange(SEQ + 1)) % CONFIG.vocab_size
        cut = SEQ // 2 + 3
        seg = np.where(np.arange(SEQ) < cut, 1, 2).astype(np.int32)
        pos = np.where(np.arange(SEQ) < cut, np.arange(SEQ), np.arange(SEQ) - cut)
        mask = (rng.random((BATCH, SEQ)) > 0.1).astype(np.float32)
        out.append({"inputs": toks[:, :-1].astype(np.int32),
                    "targets": toks[:, 1:].astype(np.int32),
                    "segment_ids": np.broadcast_to(seg, (BATCH, SEQ)).copy(),
                    "positions": np.broadcast_to(pos, (BATCH, SEQ)).astype(np.int32),
                    "loss_mask": mask})
    return out


# Sharding reorders the float32 reductions of every step (loss, gradients, Adam moments), and
# 5 steps carry the difference forward. At the loss scale (~4.9, one ulp = 4.8e-7) 24 ulps
# (1.1e-5) is the budget; x86 CPUs show one ulp.
LOSS_ATOL = f32_atol(np.log(CONFIG.vocab_size), 24)


def train_losses(ici, microbatches: int = 1, data=None) -> tuple[list[float], dict]:
    devices = jax.devices()[: int(np.prod(ici))]
    mesh = pt.create_mesh(ici, devices=devices)
    tx, schedule = optim.make_optimizer(optim.OptimizerConfig(learning_rate=3e-3, warmup_steps=1),
                                        STEPS)
    spec = state_lib.build_state_spec(lambda r: build_model(CONFIG, r), tx, mesh,
                                      pt.LOGICAL_AXIS_RULES)
    state = state_lib.init_state(spec, seed=0)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(spec.shardings),
                              strict=True):
        assert leaf.sharding == sharding  # created sharded, never whole on one device
    train_step = step_lib.jit_train_step(spec, schedule,
                                         step_lib.StepConfig(microbatches=microbatches))
    sharding = pt.batch_sharding(mesh, pt.LOGICAL_AXIS_RULES)
    losses, metrics = [], {}
    with jax.set_mesh(mesh):
        for b in data or batches():
            state, metrics = train_step(state, {k: jax.device_put(v, sharding)
                                                for k, v in b.items()})
            losses.append(float(metrics["loss"]))
    return losses, jax.device_get(metrics)


@pytest.fixture(scope="module")
def reference():
    return train_losses((1, 1, 1))


@pytest.mark.parametrize("ici", [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)])
@pytest.mark.slow
def test_sharded_matches_single_device(ici, reference):
    losses, _ = train_losses(ici)
    np.testing.assert_allclose(losses, reference[0], atol=LOSS_ATOL, rtol=0)
    assert reference[0][-1] < reference[0][0]  # it trains


@pytest.mark.slow
def test_grad_accumulation_matches_full_batch(reference):
    losses, _ = train_losses((2, 2, 1), microbatches=2)
    np.testing.assert_allclose(losses, reference[0], atol=LOSS_ATOL, rtol=0)


def test_nan_guard_skips_update_and_counts():
    data = batches(3)
    data[1] = dict(data[1], loss_mask=np.full((BATCH, SEQ), np.nan, np.float32))
    losses, metrics = train_losses((1, 1, 1), data=data)
    assert np.isfinite(losses[0]) and not np.isfinite(losses[1])
    assert int(metrics["skipped_steps"]) == 1 and int(metrics["bad_streak"]) == 0
    assert np.isfinite(losses[2])


@pytest.mark.slow
def test_loss_mask_and_abstract_batch_for_aot():
    mesh = pt.create_mesh((1, 1, 1), devices=jax.devices()[:1])
    tx, _ = optim.make_optimizer(optim.OptimizerConfig(), 10)
    spec = state_lib.build_state_spec(lambda r: build_model(CONFIG, r), tx, mesh,
                                      pt.LOGICAL_AXIS_RULES)
    abstract = step_lib.abstract_batch(spec, BATCH, SEQ)
    assert abstract["loss_mask"].dtype == jnp.float32 and abstract["inputs"].shape == (BATCH, SEQ)
    state = state_lib.init_state(spec, 0)
    b = batches(1)[0]
    full, n_full = step_lib.token_loss_sums(spec, state["params"], b)
    b0 = dict(b, loss_mask=np.zeros_like(b["loss_mask"]))
    zero, n_zero = step_lib.token_loss_sums(spec, state["params"], b0)
    assert float(n_full) == float(b["loss_mask"].sum()) and float(zero) == 0 and n_zero == 0
