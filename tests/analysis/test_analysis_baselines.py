"""The same analyses per layer for the discrete baselines (sequential and parallel blocks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import tiny_model
from numerics import F32_EPS

from ode_lm.analysis import model_access
from ode_lm.analysis.trajectory import trajectory
from ode_lm.models.common import attention_mask
from ode_lm.models.vector_field import parallel_residual, sequential_residual

TOKENS = np.array([4, 1, 30, 7, 12, 50])


def _baseline(architecture: str, flavour: str):
    return tiny_model(architecture=architecture, flavour=flavour, d_model=16, num_layers=3,
                      max_seq_len=16, init_std=0.2)


@pytest.fixture(scope="module", params=[("sequential", "gpt2"), ("parallel", "llama")])
def baseline(request):
    return _baseline(*request.param)


def test_layer_states_end_at_the_forward_pass(baseline):
    traj = trajectory(baseline, TOKENS)
    assert traj.states.shape == (4, len(TOKENS), 16)
    # float32 layer times l/L: at most two roundings of half an ulp each
    np.testing.assert_allclose(traj.times, [0, 1 / 3, 2 / 3, 1], rtol=0, atol=F32_EPS)
    logits = nnx.jit(lambda m, x: m(x))(baseline, jnp.asarray(TOKENS)[None])
    np.testing.assert_allclose(baseline.logits(jnp.asarray(traj.states[-1])[None]), logits,
                               atol=1e-5)


def test_per_layer_spectra_match_direct_eigenvalues(baseline):
    spec = model_access.model_spectra(baseline)
    assert spec.depth_kind == "layer" and spec.depth.tolist() == [0, 1, 2]
    assert spec.qk.shape == (3, 2, 8) and spec.mlp.shape == (3, 16)
    w = jax.device_get(baseline.blocks.stacked())
    wv = np.asarray(w["qkv_kernel"][1, :, 2, 1], np.float64)  # layer 1, V, head 1
    wo = np.asarray(w["out_kernel"][1, 1], np.float64)
    ev = np.linalg.eigvals(wv @ wo)
    ev = ev[np.argsort(-np.abs(ev))][:8]
    # Both sides: the *same* stored float32 weights, cast to float64, decomposed by LAPACK in
    # float64 (the small r x r product vs the full d x d one): only float64 rounding (~1e-16
    # relative) times the eigenvalue condition separates them, so 1e-9 is loose, not tight.
    np.testing.assert_allclose(np.sort_complex(ev), np.sort_complex(spec.ov[1, 1]), atol=1e-9)


@pytest.mark.slow
def test_baseline_lyapunov_is_the_layer_map_tangent(baseline):
    cfg = baseline.config
    j = 4
    res = model_access.model_lyapunov(baseline, TOKENS, position=j, chunk_size=8)
    assert res.num_steps == 3 and res.solver == "euler"
    # Brute force: Q ← Q + ∂F_l(x)_j/∂x_i · Q with F_l the residual update of layer l.
    residual = parallel_residual if cfg.architecture == "parallel" else sequential_residual
    pos = jnp.arange(len(TOKENS))[None]
    mask = attention_mask(jnp.ones((1, len(TOKENS)), jnp.int32))
    stacked = baseline.blocks.stacked()
    x = baseline.embed(jnp.asarray(TOKENS)[None])[0]
    d = x.shape[-1]
    q = np.broadcast_to(np.eye(d), (len(TOKENS), d, d)).copy()
    logs = np.zeros((len(TOKENS), d))

    def update(y, w):
        out = residual(cfg, w, y[None], pos, mask)[0]
        return out if cfg.architecture == "parallel" else out - y

    jacobian = jax.jit(jax.jacobian(lambda y, w: update(y, w)[j]))
    for layer in range(3):
        w = jax.tree.map(lambda a, layer=layer: a[layer], stacked)
        jac = np.swapaxes(np.asarray(jacobian(x, w)), 0, 1)
        x = x + update(x, w)
        q, r = np.linalg.qr(q + jac.astype(np.float64) @ q)
        logs += np.log(np.abs(np.diagonal(r, axis1=1, axis2=2)))
    np.testing.assert_allclose(res.exponents, -np.sort(-logs, axis=-1), atol=2e-4)
    assert np.all(res.exponents[j + 1:] == 0.0)


def test_baseline_rejects_other_step_counts():
    m = _baseline("sequential", "gpt2")
    with pytest.raises(ValueError, match="exactly 3 layers"):
        model_access.model_lyapunov(m, TOKENS, num_steps=6)
    with pytest.raises(ValueError, match="exactly 3 layers"):
        trajectory(m, TOKENS, solver="rk4")
