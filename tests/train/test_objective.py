"""The training objective's terms (training/objective.py) and the train step built on them:
host draws per (seed, step), compiled variants equal to the same choice made in one
program, each term's loss, the FLOPs a step counts, and a term defined here that the step
runs without being edited."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import model_helpers
import numpy as np
import optax
import pytest
from numerics import F32_EPS

from ode_lm import partitioning
from ode_lm.errors import SettingError
from ode_lm.models import build_model
from ode_lm.models.accounting import flops_per_token
from ode_lm.models.solve import Solve
from ode_lm.training import metrics as metrics_lib
from ode_lm.training import objective as obj
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib

# Two compiles of the same float32 computation reassociate sums of O(100) terms: a few ulps
# of the terms' magnitude each (tests/numerics.py); gradients pass through the whole solve.
RTOL = 64 * F32_EPS  # ≈ 7.6e-6
GRAD_ULPS = 1024  # of the largest gradient entry, after the backward pass through the solve


def tiny_config(**kw):
    return model_helpers.tiny_config(model_helpers.LIVELY, max_seq_len=16, **kw)


def _spec(cfg, tx=None):
    mesh = partitioning.create_mesh((1, 1, 1), devices=jax.devices()[:1])
    return state_lib.build_state_spec(lambda rngs: build_model(cfg, rngs),
                                      tx or optax.adam(1e-3), mesh, partitioning.axis_rules())


def _batch(seed: int = 0):
    x = np.random.default_rng(seed).integers(0, 64, (4, 17)).astype(np.int32)
    return {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": np.ones((4, 16), np.int32),
            "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
            "loss_mask": np.ones((4, 16), np.float32)}


def _close(a, b, rtol=RTOL, atol=0.0):
    return jax.tree.all(jax.tree.map(
        lambda x, y: bool(jnp.allclose(x, y, rtol=rtol, atol=atol)), a, b))


ANYTIME = (obj.RandomSteps(choices=(1, 2, 4), weights=(3.0, 2.0, 1.0)),
           obj.KineticEnergy(weight=0.1),
           obj.Distillation(weight=0.5, num_steps=(1, 2), share=0.5),
           obj.SolverShare(share=0.5, num_steps=1))


# ------------------------------------------------------------------------------ draws


@pytest.mark.parametrize("term", [obj.Distillation(share=0.3), obj.SolverShare(share=0.3),
                                  obj.SolverDistillation(share=0.3)])
def test_host_draws_are_a_function_of_seed_and_step_at_the_share(term):
    draws = [term.choose(0, s) for s in range(4000)]
    assert draws == [term.choose(0, s) for s in range(4000)]  # a pure function
    assert draws != [term.choose(1, s) for s in range(4000)]  # the seed matters
    # binomial std at n = 4000, p = 0.3 is 0.0072: 5 sigma
    assert abs(np.mean(draws) - 0.3) < 0.04
    assert set(term.variants()) == {False, True}
    assert obj.Distillation(share=1.0).variants() == (True,)


def test_a_ramped_share_draws_each_step_at_its_share_and_holds_after_the_ramp():
    term = obj.SolverShare(share=0.1, final=0.5, ramp_steps=4000)
    assert term.share_at(0) == pytest.approx(0.1)
    assert term.share_at(2000) == pytest.approx(0.3)
    assert term.share_at(9000) == pytest.approx(0.5)
    early = np.mean([term.choose(0, s) for s in range(0, 1000)])  # share 0.1 .. 0.2
    late = np.mean([term.choose(0, s) for s in range(4000, 8000)])  # share 0.5
    # binomial std: 0.013 (n = 1000, p <= 0.2) and 0.008 (n = 4000, p = 0.5): 5 sigma
    assert abs(early - 0.15) < 0.065 and abs(late - 0.5) < 0.04
    assert term.variants() == (False, True)
    assert [term.choose(3, s) for s in range(50)] == [term.choose(3, s) for s in range(50)]


@pytest.mark.parametrize("make", [obj.Distillation, obj.SolverShare,
                                  obj.SolverDistillation])
def test_block_draws_hold_the_share_in_every_block_and_stay_uniform(make):
    iid, blocked = make(share=0.25), make(share=0.25, block_steps=20)
    # one step leaves the i.i.d. draw as it was: the setting changes no existing run
    assert [make(share=0.25, block_steps=1).choose(5, s) for s in range(200)] == \
        [iid.choose(5, s) for s in range(200)]
    draws = [blocked.choose(0, s) for s in range(4000)]
    assert draws == [blocked.choose(0, s) for s in range(4000)]  # a pure function
    assert draws != [blocked.choose(1, s) for s in range(4000)]  # the seed matters
    # 0.25 * 20: exactly five drawn steps in every block of 20 (i.i.d. draws vary)
    assert {sum(draws[b:b + 20]) for b in range(0, 4000, 20)} == {5}
    assert len({sum(iid.choose(0, s) for s in range(b, b + 20)) for b in range(0, 4000, 20)}) > 1
    # each step's own float is uniform: every position of a block is drawn at the share
    # (binomial std at n = 200 blocks, p = 0.25 is 0.031: 5 sigma)
    at = np.mean([[blocked.choose(seed, b + i) for i in range(20)]
                  for seed in range(10) for b in range(0, 400, 20)], axis=0)
    assert np.all(np.abs(at - 0.25) < 0.16)


def test_a_ramped_share_with_blocks_draws_its_share_in_each_block():
    term = obj.SolverShare(share=0.05, final=0.25, ramp_steps=600, block_steps=20)
    counts = [sum(term.choose(0, s) for s in range(b, b + 20)) for b in range(0, 1200, 20)]
    expected = [sum(term.share_at(s) for s in range(b, b + 20)) for b in range(0, 1200, 20)]
    assert all(abs(c - e) <= 2 for c, e in zip(counts, expected, strict=True))
    assert counts[-10:] == [5] * 10  # held at the final share


def test_terms_draw_independently_of_each_other():
    a, b = obj.Distillation(share=0.5), obj.SolverShare(share=0.5)
    both = np.mean([a.choose(0, s) and b.choose(0, s) for s in range(4000)])
    assert abs(both - 0.25) < 0.04  # not the same stream


def test_objective_enumerates_every_variant_it_can_draw():
    objective = obj.Objective(ANYTIME)
    variants = objective.variants()
    assert len(variants) == 4
    assert {objective.variant(0, s) for s in range(200)} == set(variants)
    assert obj.Objective(()).variants() == [()]


def test_weighted_in_program_draws_follow_the_weights():
    keys = jax.random.split(jax.random.key(0), 4000)
    drawn = np.asarray(jax.vmap(lambda k: obj.draw(k, (2, 3, 8), (2.0, 1.0, 1.0)))(keys))
    freq = [np.mean(drawn == n) for n in (2, 3, 8)]
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.25], atol=0.04)  # binomial 5 sigma
    never = np.asarray(jax.vmap(lambda k: obj.draw(k, (2, 3), (0.0, 1.0)))(keys[:200]))
    assert set(never.tolist()) == {3}


@pytest.mark.parametrize("make, match", [
    (lambda: obj.RandomSteps(choices=(0, 2)), "RandomSteps.choices"),
    (lambda: obj.RandomSteps(choices=(2, 3), weights=(1.0,)), "RandomSteps.weights"),
    (lambda: obj.RandomSteps(choices=(2, 3), weights=(0.0, 0.0)), "RandomSteps.weights"),
    (lambda: obj.KineticEnergy(weight=-1.0), "KineticEnergy.weight"),
    (lambda: obj.KineticEnergy(final=1.0), "ramp_steps"),
    (lambda: obj.KineticEnergy(final=-1.0, ramp_steps=10), "KineticEnergy.final"),
    (lambda: obj.Distillation(weight=0.0), "Distillation.weight"),
    (lambda: obj.Distillation(num_steps=(0,)), "Distillation.num_steps"),
    (lambda: obj.Distillation(share=0.0), "Distillation.share"),
    (lambda: obj.Distillation(row_stride=0), "Distillation.row_stride"),
    (lambda: obj.Distillation(block_steps=0), "Distillation.block_steps"),
    (lambda: obj.SolverShare(block_steps=0), "SolverShare.block_steps"),
    (lambda: obj.SolverDistillation(block_steps=-1), "SolverDistillation.block_steps"),
    (lambda: obj.SolverDistillation(row_stride=0), "SolverDistillation.row_stride"),
    (lambda: obj.SolverShare(share=1.5), "SolverShare.share"),
    (lambda: obj.SolverShare(solver="rk5"), "rk5"),
    (lambda: obj.SolverShare(num_steps=0), "SolverShare.num_steps"),
    (lambda: obj.SolverShare(final=1.5, ramp_steps=10), "SolverShare.final"),
    (lambda: obj.SolverShare(final=0.5), "ramp_steps"),
    (lambda: obj.SolverDistillation(share=0.0), "SolverDistillation.share"),
    (lambda: obj.SolverDistillation(weight=0.0), "SolverDistillation.weight"),
    (lambda: obj.SolverDistillation(share=1.5), "SolverDistillation.share"),
    (lambda: obj.SolverDistillation(solver="rk5"), "rk5"),
    (lambda: obj.SolverDistillation(num_steps=0), "SolverDistillation.num_steps"),
    (lambda: step_lib.StepConfig(terms=("kinetic",)), "expected training-objective terms"),
    (lambda: step_lib.StepConfig(num_steps=4, terms=(obj.RandomSteps(),)), "not both"),
    (lambda: step_lib.StepConfig(terms=(obj.KineticEnergy(), obj.KineticEnergy())),
     "at most once"),
    (lambda: step_lib.StepConfig(solver="rk5"), "StepConfig.solver"),
])
def test_bad_term_settings_are_refused_when_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --------------------------------------------------------------------------- the step


@pytest.mark.slow
def test_a_host_chosen_variant_equals_the_same_choice_made_in_one_program():
    """Each compiled variant gives the loss, metrics and gradients of one program that
    holds every variant and picks one with a traced index (lax.switch)."""
    spec = _spec(tiny_config(random_grid_offset=True))
    config = step_lib.StepConfig(terms=ANYTIME, dropout=True)
    variants = config.objective.variants()
    state = state_lib.init_state(spec, 0)
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    step = jnp.asarray(3, jnp.int32)
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
    branches = [step_lib.make_objective_grads(spec, config, v) for v in variants]
    keys = set()
    for branch in branches:  # every variant outputs the metrics its terms own
        keys |= set(jax.eval_shape(branch, state["params"], batch, step, key)[1])

    def pad(fn):  # lax.switch needs one output structure: absent metrics as NaN
        def run(*args):
            loss, metrics, grads = fn(*args)
            return loss, {k: metrics.get(k, jnp.float32(jnp.nan)) for k in sorted(keys)}, grads
        return run

    @jax.jit
    def in_one_program(index, params):
        return jax.lax.switch(index, [pad(b) for b in branches], params, batch, step, key)

    with jax.set_mesh(spec.mesh):
        for i, branch in enumerate(branches):
            loss, metrics, grads = jax.jit(branch)(state["params"], batch, step, key)
            loss_1, metrics_1, grads_1 = in_one_program(i, state["params"])
            np.testing.assert_allclose(float(loss), float(loss_1), rtol=RTOL)
            for name, value in metrics.items():
                np.testing.assert_allclose(float(value), float(metrics_1[name]), rtol=RTOL)
            scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
            assert _close(grads, grads_1, rtol=0.0, atol=GRAD_ULPS * F32_EPS * scale), variants[i]


@pytest.mark.slow
def test_random_step_counts_are_seeded_and_drawn_from_the_set():
    spec = _spec(tiny_config(random_grid_offset=True))
    config = step_lib.StepConfig(terms=(obj.RandomSteps(choices=(1, 2, 4)),
                                        obj.KineticEnergy(weight=0.1)), dropout=True)

    def run(seed, steps=6):
        fn = step_lib.jit_train_step(spec, optax.constant_schedule(1e-3), config, seed)
        state, ns, losses = state_lib.init_state(spec, seed), [], []
        with jax.set_mesh(spec.mesh):
            for i in range(steps):
                state, m = fn(state, _batch(i), i)
                ns.append(int(m["num_steps"]))
                losses.append(float(m["loss"]))
                assert float(m["kinetic_energy"]) > 0
        return ns, losses, state

    ns, losses, state = run(0)
    ns2, losses2, state2 = run(0)
    assert ns == ns2 and losses == losses2  # deterministic given the seed
    assert _close(state["params"], state2["params"], rtol=0.0)
    assert set(ns) <= {1, 2, 4} and len(set(ns)) > 1, ns
    ns3, _, _ = run(7, steps=12)
    assert ns3[:6] != ns or len(set(ns3)) > 1


@pytest.mark.slow
def test_the_step_is_deterministic_given_the_seed_and_logs_each_terms_draws():
    spec = _spec(tiny_config(random_grid_offset=True))
    config = step_lib.StepConfig(terms=ANYTIME, dropout=True)

    def run(seed, steps=8):
        fn = step_lib.jit_train_step(spec, optax.constant_schedule(1e-3), config, seed)
        state, rows = state_lib.init_state(spec, seed), []
        with jax.set_mesh(spec.mesh):
            for i in range(steps):
                state, m = fn(state, _batch(i), i)
                rows.append({k: float(v) for k, v in m.items()})
        return rows, state, fn

    rows, state, fn = run(0)
    rows2, state2, _ = run(0)
    assert rows == rows2 and _close(state["params"], state2["params"], rtol=0.0)
    for i, row in enumerate(rows):
        distill, share = fn.variant(i)[2:]
        assert ("distill_loss" in row) == distill and row["solver_share"] == float(share)
        if share:  # a shared-solver step reports its solver's N
            assert row["num_steps"] == 1.0
    assert any("distill_loss" in r for r in rows) and any(r["solver_share"] for r in rows)
    assert {r["num_steps"] for r in rows} <= {1.0, 2.0, 4.0}
    rows3, _, _ = run(3)
    assert [r["loss"] for r in rows3] != [r["loss"] for r in rows]


def _distilled_step(term, w: float, student: tuple[int, str], stride: int = 1):
    """A step of Euler N=3 with ``term`` against the hand-written objective
    CE(Euler N=3) + w·KL(stop_gradient(p_N=3) ‖ p_student), the KL over rows 0, stride, …
    per counted token of those rows: (the step's metrics, the KL of the pre-update params,
    the main solve's CE, the reference gradients)."""
    spec = _spec(tiny_config())
    config = step_lib.StepConfig(terms=(obj.RandomSteps(choices=(3,)), term))
    state = state_lib.init_state(spec, 0)
    params = state["params"]
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    rows = {k: v[::stride] for k, v in batch.items()}
    run = lambda p, n, solver, b=batch: spec.model(p)(b["inputs"], b["positions"],
                                                      b["segment_ids"],
                                                      solve=Solve(solver, n))
    tokens = float(jnp.sum(rows["loss_mask"]))

    def kl_to(p, teacher):
        log_t = jax.nn.log_softmax(teacher[::stride])
        log_s = jax.nn.log_softmax(run(p, *student, b=rows))
        return jnp.sum(jnp.exp(log_t) * (log_t - log_s)) / tokens

    def objective(p):
        logits = run(p, 3, "euler")
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                      batch["targets"]))
        return ce + w * kl_to(p, jax.lax.stop_gradient(logits)), ce

    (_, ce), grads = jax.value_and_grad(objective, has_aux=True)(params)
    fn = jax.jit(step_lib.make_train_step(spec, optax.constant_schedule(0.0), config))
    with jax.set_mesh(spec.mesh):
        _, m = fn(state, batch)
    return m, kl_to(params, run(params, 3, "euler")), ce, grads


@pytest.mark.slow
def test_distill_loss_is_the_kl_from_the_main_to_the_coarse_solve():
    """The logged term is KL(p_N=3 ‖ p_N=1) of the pre-update params, the reported loss stays
    the main solve's cross-entropy, and the teacher gets no gradient."""
    m, kl, ce, grads = _distilled_step(obj.Distillation(weight=0.7, num_steps=(1,)), 0.7,
                                       (1, "euler"))
    np.testing.assert_allclose(float(m["distill_loss"]), float(kl), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), float(ce), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
    assert float(m["distill_num_steps"]) == 1.0


@pytest.mark.slow
def test_solver_distillation_pulls_the_second_solve_to_the_main_one():
    """With a SolverDistillation step the objective is CE(Euler N=3) + w·KL(p_Euler ‖ p_RK4
    N=1), the teacher (the main solve) under stop_gradient: the logged term is that KL, the
    reported loss the main solve's cross-entropy, the gradient that of the sum."""
    term = obj.SolverDistillation(weight=1.5, share=1.0, solver="rk4", num_steps=1)
    m, kl, ce, grads = _distilled_step(term, 1.5, (1, "rk4"))
    np.testing.assert_allclose(float(m["solver_distill_loss"]), float(kl), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), float(ce), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("term", [
    obj.Distillation(weight=0.7, num_steps=(1,), row_stride=2),
    obj.SolverDistillation(weight=0.7, share=1.0, solver="rk4", num_steps=1, row_stride=4)])
def test_a_row_stride_runs_the_second_solve_on_every_kth_row(term):
    """With ``row_stride`` k the further solve sees rows 0, k, 2k, …: the term is the KL over
    those rows per counted token of theirs, the gradient that of that objective."""
    solver = "euler" if isinstance(term, obj.Distillation) else "rk4"
    m, kl, ce, grads = _distilled_step(term, 0.7, (1, solver), stride=term.row_stride)
    logged = m["distill_loss" if solver == "euler" else "solver_distill_loss"]
    np.testing.assert_allclose(float(logged), float(kl), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), float(ce), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)


def test_a_row_stride_that_does_not_divide_the_microbatch_is_refused_in_one_line():
    spec = _spec(tiny_config())
    term = obj.SolverDistillation(share=1.0, num_steps=1, row_stride=3)
    fn = jax.jit(step_lib.make_train_step(spec, optax.constant_schedule(0.0),
                                          step_lib.StepConfig(terms=(term,))))
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    with jax.set_mesh(spec.mesh), pytest.raises(
            SettingError,
            match=r"SolverDistillation.row_stride=3: the microbatch has 4 rows"):
        fn(state_lib.init_state(spec, 0), batch)


def test_kinetic_energy_is_integrated_and_logged_only_with_its_term():
    """Without ``KineticEnergy`` the step integrates no energy and logs none; with it the
    logged value is the main solve's ∫ mean(f²) dt; on a discrete model the term is refused
    in one line (the solve has no integral)."""
    spec = _spec(tiny_config())
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    state = state_lib.init_state(spec, 0)
    plain = jax.jit(step_lib.make_train_step(spec, optax.constant_schedule(0.0),
                                             step_lib.StepConfig(num_steps=3)))
    with_ke = jax.jit(step_lib.make_train_step(
        spec, optax.constant_schedule(0.0),
        step_lib.StepConfig(num_steps=3, terms=(obj.KineticEnergy(weight=0.0),))))
    with jax.set_mesh(spec.mesh):
        _, m_plain = plain(state, batch)
        state = state_lib.init_state(spec, 0)
        _, m = with_ke(state, batch)
    assert "kinetic_energy" not in m_plain
    _, stats = spec.model(state["params"]).body(
        spec.model(state["params"]).embed(batch["inputs"], batch["positions"]),
        batch["positions"], batch["segment_ids"], return_stats=True,
        solve=Solve(None, 3, integrate=("kinetic_energy",)))
    np.testing.assert_allclose(float(m["kinetic_energy"]), float(stats["kinetic_energy"]),
                               rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), float(m_plain["loss"]), rtol=1e-6)
    discrete = _spec(tiny_config(architecture="sequential", num_layers=2))
    fn = jax.jit(step_lib.make_train_step(discrete, optax.constant_schedule(0.0),
                                          step_lib.StepConfig(terms=(obj.KineticEnergy(),))))
    with jax.set_mesh(discrete.mesh), pytest.raises(
            ValueError, match=r"^SequentialLM: cannot run the solve "
            r"Solve\(integrate=\('kinetic_energy',\)\): a discrete model runs its 2 layers"):
        fn(state_lib.init_state(discrete, 0), batch)


def test_kinetic_energy_ramp_weights_the_step_as_a_constant_weight_would():
    """At step s the ramped step takes the update of a constant-weight step at
    λ(s) = λ0 + (λ1 − λ0)·min(s / ramp, 1), and logs λ(s)."""
    spec = _spec(tiny_config())
    ramp = step_lib.StepConfig(num_steps=2, terms=(
        obj.KineticEnergy(weight=1.0, final=5.0, ramp_steps=4),))
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    state = state_lib.init_state(spec, 0)
    sched = optax.constant_schedule(1e-3)
    with jax.set_mesh(spec.mesh):
        for s, lam in ((0, 1.0), (2, 3.0), (4, 5.0), (9, 5.0)):
            at = {**state, "step": jnp.asarray(s, state["step"].dtype)}
            new, m = jax.jit(step_lib.make_train_step(spec, sched, ramp))(at, batch)
            const = step_lib.StepConfig(num_steps=2, terms=(obj.KineticEnergy(weight=lam),))
            ref, m_ref = jax.jit(step_lib.make_train_step(spec, sched, const))(at, batch)
            assert float(m["kinetic_energy_weight"]) == pytest.approx(lam)
            np.testing.assert_allclose(float(m["grad_norm"]), float(m_ref["grad_norm"]),
                                       rtol=1e-5)
            assert _close(new["params"], ref["params"], rtol=1e-5, atol=1e-7)
    assert "kinetic_energy_weight" not in m_ref  # constant weight: not logged


# ----------------------------------------------------------------------------- FLOPs


@pytest.mark.slow
def test_a_steps_flops_count_its_solvers_evaluations_and_reach_mfu():
    cfg = tiny_config()
    spec = _spec(cfg)
    state = state_lib.init_state(spec, 0)
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    tokens = 4 * 16
    count = lambda n, solver: flops_per_token(cfg, n, solver=solver, seq_len=16,
                                              tokens_per_batch=tokens).training
    cases = [((), count(None, None)),  # the model's own N and solver
             ((obj.SolverShare(share=1.0, solver="rk4", num_steps=2),), count(2, "rk4")),
             ((obj.Distillation(num_steps=(1,)),), count(None, None) + count(1, "euler")),
             ((obj.SolverDistillation(share=1.0, num_steps=2),),
              count(None, None) + count(2, "rk4")),
             ((obj.SolverDistillation(share=1.0, num_steps=2, row_stride=2),),  # half the rows
              count(None, None) + count(2, "rk4") / 2),
             ((obj.Distillation(num_steps=(1,), row_stride=4),),
              count(None, None) + count(1, "euler") / 4)]
    with jax.set_mesh(spec.mesh):
        for terms, expected in cases:
            fn = jax.jit(step_lib.make_train_step(spec, optax.constant_schedule(0.0),
                                                  step_lib.StepConfig(terms=terms)))
            _, m = fn(state, batch)
            np.testing.assert_allclose(float(m["flops_per_token"]), expected, rtol=RTOL)
    assert count(2, "rk4") == pytest.approx(4 * count(2, "euler") - 3 * count(0, "euler"))
    # the window's MFU uses the steps' own count, not the configured one
    window = metrics_lib.MetricWindow(tokens_per_step=100, flops_per_token=1.0, peak_flops=1e6,
                                      total_steps=10, clock=iter([0.0, 1.0, 2.0]).__next__)
    row = dict(loss=2.0, grad_norm=1.0, param_norm=3.0, learning_rate=0.1, skipped_steps=0,
               num_steps=2.0, kinetic_energy=0.5, flops_per_token=50.0)
    for dispatched in (1, 2):
        window.add(row, dispatched=dispatched)

    class Writer(metrics_lib.MetricWriter):
        def write_scalars(self, step, scalars):
            self.scalars = dict(scalars)

        def write_texts(self, step, texts):
            pass

    writer = Writer()
    window.log(2, writer)
    assert writer.scalars["train/mfu"] == pytest.approx(50.0 * 100 / 1e6)


def test_window_averages_a_terms_metrics_over_the_steps_that_ran_it():
    base = dict(loss=2.0, grad_norm=1.0, param_norm=3.0, learning_rate=0.1, skipped_steps=0,
                num_steps=2.0, kinetic_energy=0.5)
    plain = metrics_lib.compute(metrics_lib.accumulate(None, base))
    assert not {"distill_loss", "distill_num_steps", "solver_share"} & set(plain)
    window = metrics_lib.accumulate(None, {**base, "distill_loss": 0.2, "distill_num_steps": 1})
    window = metrics_lib.accumulate(window, base)  # a step without distillation
    window = metrics_lib.accumulate(window, {**base, "distill_loss": 0.4, "distill_num_steps": 3})
    values = metrics_lib.compute(window)
    assert values["distill_loss"] == pytest.approx(0.3)
    assert values["distill_num_steps"] == pytest.approx(2.0)
    assert values["loss"] == pytest.approx(2.0)
    # a term of the user's logs its own metric; the NaN streak and token count are not averaged
    window = metrics_lib.accumulate(None, {**base, "logit_penalty": 1.5, "tokens": 64,
                                           "bad_streak": 0})
    values = metrics_lib.compute(window)
    assert values["logit_penalty"] == 1.5 and not {"tokens", "bad_streak"} & set(values)


# ------------------------------------------------------------------ a term of the test's


@dataclasses.dataclass(frozen=True)
class LogitPenalty(obj.Term):
    """A term defined outside the package: on a drawn half of the steps, w·mean(logsumexp²)
    of the main solve's logits (a z-loss)."""

    weight: float = 0.1
    name: ClassVar[str] = "logit_penalty"

    def variants(self):
        return (False, True)

    def choose(self, seed, step):
        return self._uniform(seed, step) < 0.5

    def loss(self, inputs, choice):
        if not choice:
            return jnp.zeros(()), {}
        z = jax.nn.logsumexp(inputs.logits, axis=-1)
        penalty = jnp.sum(z ** 2 * inputs.mask()) / inputs.num_tokens
        return self.weight * penalty, {"logit_penalty": penalty}


@pytest.mark.slow
def test_a_term_defined_in_a_test_runs_without_editing_the_step():
    cfg = tiny_config()
    spec = _spec(cfg)
    config = step_lib.StepConfig(terms=(LogitPenalty(weight=0.1),))
    state = state_lib.init_state(spec, 0)
    batch = {k: jnp.asarray(v) for k, v in _batch(0).items()}
    step = jnp.asarray(0, jnp.int32)
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
    params = state["params"]

    def reference(p):
        logits = spec.model(p)(batch["inputs"], batch["positions"], batch["segment_ids"])
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))
        return ce + 0.1 * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)

    with jax.set_mesh(spec.mesh):
        loss, metrics, grads = jax.jit(step_lib.make_objective_grads(spec, config, (True,)))(
            params, batch, step, key)
        _, off_metrics, _ = jax.jit(step_lib.make_objective_grads(spec, config, (False,)))(
            params, batch, step, key)
    ref_grads = jax.grad(reference)(params)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
    assert metrics["logit_penalty"] > 0 and "logit_penalty" not in off_metrics
    assert _close(grads, ref_grads, rtol=0.0, atol=GRAD_ULPS * F32_EPS * scale)
    fn = step_lib.jit_train_step(spec, optax.constant_schedule(1e-3), config, seed=0)
    assert {fn.variant(s) for s in range(50)} == {(False,), (True,)}


@pytest.mark.slow
def test_every_variant_compiles_before_the_first_step_and_steps_as_lazily_compiled():
    """``compile_all`` compiles each variant the terms can draw, before any step; the steps
    then give the same losses, bit for bit, as programs compiled on their first draw."""
    spec = _spec(tiny_config())
    config = step_lib.StepConfig(terms=(obj.Distillation(num_steps=(1,), share=0.5),
                                        obj.SolverShare(share=0.5, num_steps=1)))
    batches = [{k: jnp.asarray(v) for k, v in _batch(i).items()} for i in range(6)]
    losses = {}
    for eager in (False, True):
        fn = step_lib.jit_train_step(spec, optax.constant_schedule(3e-3), config, seed=0)
        state = state_lib.init_state(spec, 0)
        with jax.set_mesh(spec.mesh):
            if eager:
                seconds = fn.compile_all(state, batches[0])
                assert set(seconds) == set(fn.variants()) and len(seconds) == 4
                assert all(s > 0 for s in seconds.values())
            run = []
            for i, batch in enumerate(batches):
                state, m = fn(state, batch, i)
                run.append(float(m["loss"]))
        losses[eager] = run
    assert {fn.variant(i) for i in range(6)} != {fn.variant(0)}  # more than one drawn
    assert losses[True] == losses[False]
