"""LoRA on materialised linears and on the hypernetwork's base weights; merge for export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from export_helpers import tiny_config
from flax import nnx

from ode_lm.lora import (
    LoRAModel,
    LoRASpec,
    lora_trainable,
    merge_lora,
)
from ode_lm.models import build_model
from ode_lm.models.accounting import param_count
from ode_lm.models.materialize import materialize
from ode_lm.models.solve import Solve
from ode_lm.training.optim import path_name

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 60, size=(2, 10)), jnp.int32)


def _perturb(model: LoRAModel, seed: int = 1) -> None:
    """Non-zero B so the update is visible (at init B = 0, the wrapper is the identity)."""
    for i, t in enumerate(model.targets):
        b = model.lora[t.key]["b"]
        b[...] = 0.3 * jax.random.normal(jax.random.key(seed + i), b.shape)


@pytest.mark.slow
def test_materialised_lora_is_identity_at_init_and_merges_exactly():
    ode = build_model(tiny_config("neox"), nnx.Rngs(0))
    pm = materialize(ode, 4)
    lora = LoRAModel(pm, pm.config, LoRASpec(rank=3, targets=("qkv", "mlp_out")), nnx.Rngs(1))
    assert {t.key.split("__")[-1] for t in lora.targets} == {"qkv_kernel", "mlp_out_kernel"}
    assert all(t.lead == (4,) for t in lora.targets)  # one A, B pair per layer
    np.testing.assert_array_equal(np.asarray(lora(TOKENS)), np.asarray(pm(TOKENS)))
    _perturb(lora)
    wrapped = np.asarray(lora(TOKENS))
    assert np.abs(wrapped - np.asarray(pm(TOKENS))).max() > 1e-3
    merged = merge_lora(lora)
    assert type(merged).__name__ == "ParallelLM"
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), wrapped, atol=1e-5)


@pytest.mark.slow
def test_continuous_lora_targets_hypernetwork_base_weights_at_every_depth():
    cfg = tiny_config("llama")
    ode = build_model(cfg, nnx.Rngs(0))
    lora = LoRAModel(ode, cfg, LoRASpec(rank=2, targets=("mlp_*",)), nnx.Rngs(1))
    paths = sorted("/".join(map(str, t.path)) for t in lora.targets)
    assert paths == ["block/layers/mlp_gate/w0", "block/layers/mlp_out/w0",
                     "block/layers/mlp_up/w0"]
    _perturb(lora)
    merged = merge_lora(lora)
    for steps in (2, 5):  # the low-rank update is shared by every W(t)
        solve = Solve(None, steps)
        np.testing.assert_allclose(np.asarray(merged(TOKENS, solve=solve)),
                                   np.asarray(lora(TOKENS, solve=solve)), atol=1e-5)
    delta = merged.block.layers["mlp_up"].w0[...] - ode.block.layers["mlp_up"].w0[...]
    assert np.linalg.matrix_rank(np.asarray(delta), tol=1e-6) == 2
    # the hypernetwork's time coefficients A_d are untouched
    np.testing.assert_array_equal(merged.block.layers["mlp_up"].a[...],
                                  ode.block.layers["mlp_up"].a[...])


@pytest.mark.slow
def test_gradients_reach_lora_factors_and_counts():
    cfg = tiny_config("gpt2")
    lora = LoRAModel(build_model(cfg, nnx.Rngs(0)), cfg, LoRASpec(rank=4), nnx.Rngs(1))
    params = nnx.to_pure_dict(nnx.state(lora, nnx.Param))
    pred = lora_trainable(train_embeddings=False)
    counts = param_count(params, pred)
    n_train, n_total = counts["trainable"], counts["total"]
    lora_sizes = sum(int(x.size) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                     if path_name(p).startswith("lora/"))
    assert n_train == lora_sizes == counts["lora"] and 0 < n_train < n_total
    assert n_total == param_count(lora.base)["total"] + lora_sizes
    with_emb = param_count(lora, lora_trainable(train_embeddings=True))["trainable"]
    assert with_emb == n_train + 64 * 32 + 32 * 32  # token + position embeddings (tied head)

    def loss(model):
        return jnp.mean(model(TOKENS) ** 2)

    grads = nnx.grad(loss)(lora)
    g = nnx.to_pure_dict(grads)
    b_grad = g["lora"][lora.targets[0].key]["b"]
    assert float(jnp.abs(b_grad).max()) > 0  # B starts at zero, its gradient does not


def test_target_matching_nothing_is_an_error():
    cfg = tiny_config("gpt2")
    with pytest.raises(ValueError, match=r"LoRA target\(s\) \['attn'\] match no linear layer"):
        LoRAModel(build_model(cfg, nnx.Rngs(0)), cfg, LoRASpec(targets=("qkv", "attn")),
                  nnx.Rngs(1))
    with pytest.raises(ValueError, match="mlp_gate"):  # llama-only layer on a gpt2 model
        LoRAModel(build_model(cfg, nnx.Rngs(0)), cfg, LoRASpec(targets=("mlp_gate",)),
                  nnx.Rngs(1))
    with pytest.raises(ValueError, match="rank=0"):
        LoRASpec(rank=0)


def test_factors_carry_the_kernels_logical_axes():
    """A qkv factor keeps the kernel's axes (heads → tensor) with a lora_rank axis."""
    from ode_lm.partitioning import LOGICAL_AXIS_RULES, logical_to_mesh

    ode = build_model(tiny_config("gpt2"), nnx.Rngs(0))
    lora = LoRAModel(ode, ode.config, LoRASpec(rank=2, targets=("qkv", "mlp_in")), nnx.Rngs(1))
    axes = {t.key.split("__")[-2]: t for t in lora.targets}  # ".../qkv/w0" -> "qkv"
    cfg = ode.config
    for t in axes.values():
        f = lora.lora[t.key]
        assert f["a"].out_sharding == (*t.a_axes,) and f["b"].out_sharding == (*t.b_axes,)
        assert f["a"].shape == (*t.in_shape, 2) and f["b"].shape == (2, *t.out_shape)
    assert axes["qkv"].b_axes == ("lora_rank", "qkv", "heads", "kv")
    assert lora.lora[axes["qkv"].key]["b"].shape == (2, 3, cfg.num_heads, cfg.head_dim)
    def mesh_axes(logical):
        return tuple(logical_to_mesh(logical, LOGICAL_AXIS_RULES))

    assert mesh_axes(axes["qkv"].b_axes) == (None, None, "tensor", None)
    assert mesh_axes(axes["mlp_in"].b_axes) == (None, "tensor")
    assert mesh_axes(axes["qkv"].a_axes) == ("fsdp", None)
