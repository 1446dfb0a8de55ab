"""The anytime-model recipe options of the train step: weighted random N, self-distillation
across grids and a share of higher-order-solver steps (StepConfig; docs/depth.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_depth import _batch, _spec, tiny_config

from ode_lm.training import metrics as metrics_lib
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib

ANYTIME = dict(num_steps_choices=(1, 2, 4), num_steps_weights=(3.0, 2.0, 1.0),
               kinetic_energy_weight=0.1, distill_weight=0.5, distill_num_steps_choices=(1, 2),
               solver_share=0.5, share_num_steps=1, dropout=True)


def _run(spec, config, seed, steps):
    fn = step_lib.jit_train_step(spec, optax.constant_schedule(1e-3), config)
    state = state_lib.init_state(spec, seed)
    rows = []
    with jax.set_mesh(spec.mesh):
        for i in range(steps):
            state, m = fn(state, _batch(i))
            rows.append({k: float(v) for k, v in m.items()})
    return rows, state


@pytest.mark.slow
def test_anytime_step_is_deterministic_given_the_seed_and_logs_its_draws():
    spec = _spec(tiny_config(random_grid_offset=True))
    config = step_lib.StepConfig(**ANYTIME)
    rows, state = _run(spec, config, seed=0, steps=8)
    rows2, state2 = _run(spec, config, seed=0, steps=8)
    assert rows == rows2
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     state["params"], state2["params"]))
    coarse = {r["distill_num_steps"] for r in rows}
    shared = [r["solver_share"] for r in rows]
    assert coarse <= {1.0, 2.0} and set(shared) == {0.0, 1.0}, (coarse, shared)
    assert all(r["distill_loss"] > 0 for r in rows)
    # a shared-solver step reports share_num_steps as its N; the others a drawn N
    assert all(r["num_steps"] == 1.0 for r in rows if r["solver_share"] == 1.0)
    assert {r["num_steps"] for r in rows} <= {1.0, 2.0, 4.0}
    rows3, _ = _run(spec, config, seed=3, steps=8)
    assert [r["loss"] for r in rows3] != [r["loss"] for r in rows]


@pytest.mark.slow
def test_distill_loss_is_the_kl_from_the_fine_to_the_coarse_solve():
    """Deterministic grid: the logged term is KL(p_N=3 ‖ p_N=1) of the pre-update params,
    the reported loss stays the fine solve's cross-entropy, and the teacher gets no
    gradient (the update equals the one from CE + w·KL with the teacher held fixed)."""
    spec = _spec(tiny_config())
    w = 0.7
    config = step_lib.StepConfig(num_steps_choices=(3,), distill_weight=w,
                                 distill_num_steps_choices=(1,))
    state = state_lib.init_state(spec, 0)
    params = state["params"]
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    model = spec.model(params)
    fine = model(batch["inputs"], batch["positions"], batch["segment_ids"], num_steps=3)
    tokens = float(jnp.sum(batch["loss_mask"]))

    def kl_to(p, teacher):
        coarse = spec.model(p)(batch["inputs"], batch["positions"], batch["segment_ids"],
                               num_steps=1)
        log_t = jax.nn.log_softmax(teacher)
        return jnp.sum(jnp.exp(log_t) * (log_t - jax.nn.log_softmax(coarse))) / tokens

    def objective(p):
        logits = spec.model(p)(batch["inputs"], batch["positions"], batch["segment_ids"],
                               num_steps=3)
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                      batch["targets"]))
        return ce + w * kl_to(p, jax.lax.stop_gradient(logits)), ce

    (_, ce), grads = jax.value_and_grad(objective, has_aux=True)(params)
    fn = jax.jit(step_lib.make_train_step(spec, optax.constant_schedule(0.0), config))
    with jax.set_mesh(spec.mesh):
        _, m = fn(state, batch)
    np.testing.assert_allclose(float(m["distill_loss"]), float(kl_to(params, fine)), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), float(ce), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
    assert float(m["distill_num_steps"]) == 1.0


def test_weighted_draws_follow_the_weights():
    keys = jax.random.split(jax.random.key(0), 4000)
    drawn = np.asarray(jax.vmap(lambda k: step_lib._draw(k, (2, 3, 8), (2.0, 1.0, 1.0)))(keys))
    freq = [np.mean(drawn == n) for n in (2, 3, 8)]
    # binomial std at n=4000 is ≤ 0.008: 5 sigma
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.25], atol=0.04)
    never = np.asarray(jax.vmap(lambda k: step_lib._draw(k, (2, 3), (0.0, 1.0)))(keys[:200]))
    assert set(never.tolist()) == {3}


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_steps_choices=(2, 3), num_steps_weights=(1.0,)), "num_steps_weights"),
    (dict(num_steps_choices=(2, 3), num_steps_weights=(0.0, 0.0)), "num_steps_weights"),
    (dict(distill_weight=1.0), "distill_weight"),
    (dict(distill_num_steps_choices=(1,)), "distill_weight"),
    (dict(distill_weight=1.0, distill_num_steps_choices=(0,)), "distill_num_steps_choices"),
    (dict(solver_share=1.5), "solver_share"),
    (dict(solver_share=0.5, share_solver="rk5"), "rk5"),
    (dict(kinetic_energy_weight_final=1.0), "kinetic_energy_ramp_steps"),
    (dict(kinetic_energy_weight_final=-1.0, kinetic_energy_ramp_steps=10),
     "kinetic_energy_weight_final"),
])
def test_step_config_rejects_bad_recipe_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        step_lib.StepConfig(**kwargs)


def test_window_logs_recipe_metrics_only_when_the_step_outputs_them():
    base = dict(loss=2.0, grad_norm=1.0, param_norm=3.0, learning_rate=0.1, skipped_steps=0,
                num_steps=2.0, kinetic_energy=0.5)
    plain = metrics_lib.accumulate(None, base).compute()
    assert not {"distill_loss", "distill_num_steps", "solver_share"} & set(plain)
    window = metrics_lib.accumulate(None, {**base, "distill_loss": 0.2, "distill_num_steps": 1})
    window = metrics_lib.accumulate(window, {**base, "distill_loss": 0.4, "distill_num_steps": 3})
    values = window.compute()
    assert float(values["distill_loss"]) == pytest.approx(0.3)
    assert float(values["distill_num_steps"]) == pytest.approx(2.0)


def test_kinetic_energy_ramp_weights_the_step_as_a_constant_weight_would():
    """At step s the ramped step takes the update of a constant-weight step at
    λ(s) = λ0 + (λ1 − λ0)·min(s / ramp, 1), and logs λ(s)."""
    spec = _spec(tiny_config())
    ramp = step_lib.StepConfig(num_steps=2, kinetic_energy_weight=1.0,
                               kinetic_energy_weight_final=5.0, kinetic_energy_ramp_steps=4)
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    state = state_lib.init_state(spec, 0)
    sched = optax.constant_schedule(1e-3)
    with jax.set_mesh(spec.mesh):
        for s, lam in ((0, 1.0), (2, 3.0), (4, 5.0), (9, 5.0)):
            at = {**state, "step": jnp.asarray(s, state["step"].dtype)}
            new, m = jax.jit(step_lib.make_train_step(spec, sched, ramp))(at, batch)
            const = step_lib.StepConfig(num_steps=2, kinetic_energy_weight=lam)
            ref, m_ref = jax.jit(step_lib.make_train_step(spec, sched, const))(at, batch)
            assert float(m["kinetic_energy_weight"]) == pytest.approx(lam)
            np.testing.assert_allclose(float(m["grad_norm"]), float(m_ref["grad_norm"]),
                                       rtol=1e-5)
            assert jax.tree.all(jax.tree.map(
                lambda a, b: bool(jnp.allclose(a, b, rtol=1e-5, atol=1e-7)),
                new["params"], ref["params"]))
    assert "kinetic_energy_weight" not in m_ref  # constant weight: not logged
