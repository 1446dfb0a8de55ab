"""Analysis on a real (tiny) DiffEqFormer: spectra, trajectories and Lyapunov exponents agree
with direct computations on the model's own functions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import tiny_model
from numerics import F32_EPS, f32_atol

from ode_lm.analysis import model_access
from ode_lm.analysis.trajectory import states_at, trajectory
from ode_lm.models.solve import Solve


@pytest.fixture(scope="module")
def model():
    m = tiny_model(d_model=16, max_seq_len=16, num_steps=3, sinusoidal_dim=8)
    # Make the time dependence visible: untrained hypernetworks start near W0 at every t.
    graphdef, state = nnx.split(m)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(1)
    leaves = [jnp.asarray(np.asarray(x) + 0.3 * rng.normal(size=x.shape).astype(np.float32))
              for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


TOKENS = np.array([3, 17, 5, 60, 2, 9, 41, 8])


# The two sides get W(t) from different float32 programs (weights_at(0.37) alone vs. vmapped
# over the chunk of ts): a few ulps apart. An eigenvalue moves by about its condition number
# times ||δA|| ~ eps·||A||, an *absolute* error on the scale of the spectral radius (a
# relative rtol on a small eigenvalue is meaningless). 64 ulps of the radius (7.6e-6 of it)
# leaves ~10x margin over what x86 CPUs show and still catches a wrong t (1e-2 off).
_EIG_ULPS = 64


def test_spectra_match_direct_eigenvalues_at_off_grid_t(model):
    ts = np.array([0.0, 0.37, 1.0])
    spec = model_access.model_spectra(model, ts)
    w = jax.device_get(model.weights_at(jnp.float32(0.37)))
    hd = model.config.head_dim
    for h in range(model.config.num_heads):
        wq, wk, wv = (np.asarray(w["qkv_kernel"][:, i, h], np.float64) for i in range(3))
        wo = np.asarray(w["out_kernel"][h], np.float64)
        for full, got in ((wq @ wk.T, spec.qk[1, h]), (wv @ wo, spec.ov[1, h])):
            ev = np.linalg.eigvals(full)
            ev = ev[np.argsort(-np.abs(ev))][:hd]  # the d - hd others are (numerically) zero
            np.testing.assert_allclose(np.sort_complex(ev), np.sort_complex(got), rtol=0,
                                       atol=_EIG_ULPS * F32_EPS * np.abs(ev).max())
    mlp = np.asarray(w["mlp_in_kernel"], np.float64) @ np.asarray(w["mlp_out_kernel"], np.float64)
    ev = np.linalg.eigvals(mlp)
    np.testing.assert_allclose(np.sort_complex(ev), np.sort_complex(spec.mlp[1]), rtol=0,
                               atol=f32_atol(ev, _EIG_ULPS))
    assert np.abs(spec.qk.imag).max() > 0  # complex eigenvalues are kept
    assert not np.allclose(spec.max_abs("qk")[0], spec.max_abs("qk")[2])  # depends on t


def test_spectra_mlp_subset_and_npz_round_trip(model, tmp_path):
    from ode_lm.analysis.spectra import Spectra, random_hidden_units

    units = random_hidden_units(model.config.hidden_dim, 5, seed=3)
    spec = model_access.model_spectra(model, np.linspace(0, 1, 4), units)
    assert spec.mlp.shape == (4, 5)
    spec.save(tmp_path / "s.npz")
    back = Spectra.load(tmp_path / "s.npz")
    np.testing.assert_array_equal(back.qk, spec.qk)
    np.testing.assert_array_equal(back.mlp_units, units)
    with np.load(tmp_path / "s.npz") as z:
        np.testing.assert_array_equal(z["ov_imag"], spec.ov.imag)


@pytest.mark.slow
def test_trajectory_ends_at_the_forward_pass(model):
    traj = trajectory(model, TOKENS, num_steps=5, solver="midpoint")
    assert traj.states.shape == (6, len(TOKENS), 16)
    # float32 grid times k·dt: two roundings, each at most half an ulp
    np.testing.assert_allclose(traj.times, np.linspace(0, 1, 6), rtol=0, atol=F32_EPS)
    logits = nnx.jit(lambda m, x: m(x, solve=Solve("midpoint", 5)))(
        model, jnp.asarray(TOKENS)[None])
    # the same float32 ops in two programs: XLA may reassociate the head's d_model-term dot
    # (the γ_n bound: d_model ulps of the largest logit)
    np.testing.assert_allclose(model.logits(jnp.asarray(traj.states[-1])[None]), logits,
                               rtol=0, atol=f32_atol(logits, model.config.d_model))
    # arbitrary (off-grid) times: integrating 0 → 0.2 → 0.4 ... reproduces the grid states
    # and t = 0.5, between grid points, gets a state too (one midpoint step from 0.4)
    sub = states_at(model, TOKENS, [0.2, 0.4, 0.5], max_dt=0.2, solver="midpoint")
    # (float32 grid times t0 + k·dt may differ in the last bit, ≤ F32_EPS for t ≤ 1, and the
    # sin(time_scale·ω·t) features amplify that by time_scale, ω ≤ 1; two such segments)
    np.testing.assert_allclose(sub.states[1:3], traj.states[1:3], rtol=0,
                               atol=f32_atol(traj.states[1:3], 2 * model.config.time_scale))
    assert sub.states.shape == (4, len(TOKENS), 16) and sub.num_steps == 3
    assert np.all(np.isfinite(sub.states[3])) and not np.allclose(sub.states[3], sub.states[2])


def _brute_force(model, tokens, position, num_steps):
    """Float64 Benettin with full jax.jacobian blocks of the model's vector field (Euler)."""
    positions = jnp.arange(len(tokens))[None]
    x = model.embed(jnp.asarray(tokens)[None])[0]
    field = jax.jit(lambda y, t: model.vector_field(y[None], t, positions)[0])
    jacobian = jax.jit(jax.jacobian(lambda y, t: field(y, t)[position]))
    n, d = x.shape
    dt = 1.0 / num_steps
    q = np.broadcast_to(np.eye(d), (n, d, d)).copy()
    logs = np.zeros((n, d))
    for k in range(num_steps):
        t = jnp.float32((k + 1) * dt)
        jac = np.asarray(jacobian(x, t), np.float64)
        x = x + dt * field(x, t)
        q, r = np.linalg.qr(q + dt * np.swapaxes(jac, 0, 1) @ q)
        logs += np.log(np.abs(np.diagonal(r, axis1=1, axis2=2)))
    return -np.sort(-logs, axis=-1)


@pytest.mark.slow
def test_lyapunov_on_the_model_matches_brute_force_and_is_causal(model):
    j = 5
    res = model_access.model_lyapunov(model, TOKENS, position=j, num_steps=2, chunk_size=5)
    brute = _brute_force(model, TOKENS, j, 2)
    # both sides' Jacobian entries are float32 sums over up to T·d terms, reassociated
    # differently (VJP rows vs jax.jacobian): the γ_n bound per step, on the exponents' scale
    np.testing.assert_allclose(res.exponents, brute, rtol=0,
                               atol=f32_atol(brute, 2 * len(TOKENS) * model.config.d_model))
    assert np.all(res.exponents[j + 1:] == 0.0)
    assert np.all(np.abs(res.exponents[: j + 1]).max(-1) > 0)
    assert res.tokens.tolist() == TOKENS.tolist()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: model_access.model_spectra(m, [0.5, 1.5]), r"--times"),
        (lambda m: model_access.model_lyapunov(m, np.array([1, 99])), r"\[0, 64\)"),
        (lambda m: model_access.model_lyapunov(m, TOKENS, position=8), r"--position=8"),
        (lambda m: model_access.model_lyapunov(m, np.arange(20)), r"max_seq_len=16"),
        (lambda m: trajectory(m, TOKENS, num_steps=0), r"--num_steps=0"),
        (lambda m: states_at(m, TOKENS, [0.5, 0.2]), r"--times must be sorted"),
    ],
)
def test_bad_inputs_raise_one_line_errors(model, call, match):
    with pytest.raises(ValueError, match=match):
        call(model)
