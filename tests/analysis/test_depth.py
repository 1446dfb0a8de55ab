"""Continuous depth: the adaptive solver, random step counts, the kinetic-energy regulariser,
the W(t) smoothness figure, adaptive generation and ode-lm depth-report end to end."""

from __future__ import annotations

import csv
import json
import os

import jax
import jax.numpy as jnp
import model_helpers
import numpy as np
import optax
import pytest
from flax import nnx
from model_helpers import LIVELY, greedy_uncached

from ode_lm import partitioning
from ode_lm.gin_setup import GinRecord
from ode_lm.models import ModelConfig, build_model, solvers
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib
from ode_lm.training.objective import KineticEnergy, RandomSteps


def known_field(x, t):
    """dx/dt = 5·cos(5t)·x, solved by x(t) = x₀·exp(sin 5t): non-autonomous, known."""
    return 5.0 * jnp.cos(5.0 * t) * x


def known_solution(x0, t):
    return x0 * np.exp(np.sin(5.0 * t))


@pytest.mark.parametrize("solver", ["adaptive", "dopri5"])
def test_adaptive_reaches_its_tolerance_and_nfe_falls_with_rtol(solver):
    """float64, so the error is the solver's: global error ≤ 10·rtol (local control
    accumulates over the steps; 10× covers it for these smooth fields)."""
    with jax.enable_x64(True):
        x0 = jnp.asarray([0.5, -1.0, 2.0], jnp.float64)
        truth = known_solution(np.asarray(x0), 1.0)
        nfes = []
        for rtol in (1e-6, 1e-4, 1e-2):
            x, stats = jax.jit(lambda y, r=rtol: solvers.solve_adaptive(
                known_field, y, solver=solver, rtol=r, atol=r * 1e-3))(x0)
            err = np.max(np.abs(np.asarray(x) - truth) / np.abs(truth))
            assert err <= 10 * rtol, (rtol, err)
            assert int(stats.accepted) >= 1 and int(stats.nfe) > 0
            nfes.append(int(stats.nfe))
    assert nfes[0] > nfes[1] > nfes[2], nfes


def test_adaptive_bad_tolerances_and_solver():
    with pytest.raises(ValueError, match="rtol=0"):
        solvers.solve_adaptive(known_field, jnp.ones(2), rtol=0.0)
    with pytest.raises(ValueError, match="solver='rk4'"):
        solvers.solve_adaptive(known_field, jnp.ones(2), solver="rk4")


@pytest.mark.parametrize("solver", ["euler", "midpoint", "rk4"])
def test_traced_num_steps_matches_static(solver):
    """One program for every N ≤ max_steps gives the static N-step solve (same ops)."""
    x0 = jnp.linspace(-1.0, 1.0, 4)
    fn = jax.jit(lambda n: solvers.solve(known_field, x0, num_steps=n, solver=solver,
                                         max_steps=7))
    for n in (1, 3, 7):
        static = solvers.solve(known_field, x0, num_steps=n, solver=solver)
        np.testing.assert_allclose(fn(jnp.int32(n)), static, rtol=1e-6, atol=1e-7)


def tiny_config(**kw) -> ModelConfig:
    return model_helpers.tiny_config(LIVELY, max_seq_len=16, **kw)


@pytest.mark.slow
def test_model_traced_steps_and_kinetic_energy():
    model = build_model(tiny_config(), nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    static = model(tokens, num_steps=3)
    traced = nnx.jit(lambda m, n: m(tokens, num_steps=n, max_steps=5))(model, jnp.int32(3))
    # precompute generates 3 vs 5 weight sets (another contraction shape): float32 sums
    np.testing.assert_allclose(traced, static, rtol=1e-5, atol=1e-5)
    # kinetic energy = Σ_k dt·mean(f(x_k, t_{k+1})²) along the Euler trajectory
    _, stats = model(tokens, num_steps=3, return_stats=True)
    traj = model.trajectory(tokens, num_steps=3)
    expected = sum(float(jnp.mean(jnp.square(model.vector_field(traj[k], (k + 1) / 3)))) / 3
                   for k in range(3))
    np.testing.assert_allclose(float(stats["kinetic_energy"]), expected, rtol=1e-5)
    assert int(stats["nfe"]) == 3


def _spec(cfg: ModelConfig):
    mesh = partitioning.create_mesh((1, 1, 1), devices=jax.devices()[:1])
    return state_lib.build_state_spec(lambda rngs: build_model(cfg, rngs), optax.adam(1e-3),
                                      mesh, partitioning.axis_rules())


def _batch(seed: int = 0):
    x = np.random.default_rng(seed).integers(0, 64, (4, 17)).astype(np.int32)
    return {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": np.ones((4, 16), np.int32),
            "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
            "loss_mask": np.ones((4, 16), np.float32)}


def _run_steps(spec, config, seed, steps=6):
    fn = step_lib.jit_train_step(spec, optax.constant_schedule(1e-3), config)
    state = state_lib.init_state(spec, seed)
    ns, losses = [], []
    with jax.set_mesh(spec.mesh):
        for i in range(steps):
            state, m = fn(state, _batch(i))
            ns.append(int(m["num_steps"]))
            losses.append(float(m["loss"]))
            assert float(m["kinetic_energy"]) > 0
    return ns, losses, state


@pytest.mark.slow
def test_random_step_counts_are_seeded_and_drawn_from_the_set():
    spec = _spec(tiny_config(random_grid_offset=True))
    config = step_lib.StepConfig(terms=(RandomSteps(choices=(1, 2, 4)),
                                        KineticEnergy(weight=0.1)), dropout=True)
    ns, losses, state = _run_steps(spec, config, seed=0)
    ns2, losses2, state2 = _run_steps(spec, config, seed=0)
    assert ns == ns2 and losses == losses2  # deterministic given the seed
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     state["params"], state2["params"]))
    assert set(ns) <= {1, 2, 4} and len(set(ns)) > 1, ns
    ns3, _, _ = _run_steps(spec, config, seed=7, steps=12)
    assert ns3[:6] != ns or len(set(ns3)) > 1


def test_smoothness_separates_paper_and_smooth_time_features():
    """At init, the paper's sin(1000·t·ω) features move W(t) orders of magnitude faster."""
    from ode_lm.analysis.depth import weight_smoothness

    rates = {}
    for scale, period in ((1000.0, 10000.0), (4.0, 100.0)):
        model = build_model(tiny_config(time_scale=scale, time_max_period=period), nnx.Rngs(0))
        rates[scale] = weight_smoothness(model.weights_at, num_times=33)["max"]
    assert rates[1000.0] > 30 * rates[4.0], rates


@pytest.mark.slow
def test_adaptive_generation_equals_uncached_greedy():
    from ode_lm.generation import generate

    model = build_model(tiny_config(), nnx.Rngs(0))
    out = generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=4, solver="adaptive", rtol=1e-2)
    ref = greedy_uncached(model, [1, 2, 3, 4, 5], 4, solver="adaptive", rtol=1e-2)
    np.testing.assert_array_equal(out[0], ref)
    batch = generate(model, [[1, 2, 3, 4, 5], [7, 8]], max_new_tokens=3, solver="dopri5")
    assert batch.shape == (2, 3) and batch.max() < 64


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory):
    """A tiny trained run through the real trainer, on the byte-level built-in corpus, its
    evals (step 2 and the final, step 3) at N=2, 3 (its own), RK4 at N=3 and the adaptive
    solver: (model dir, result, the lines the trainer printed)."""
    from ode_lm.training.trainer import TrainConfig, Trainer

    root = tmp_path_factory.mktemp("depth")
    data = _tiny_data(root)
    cfg = tiny_config(vocab_size=384, time_scale=4.0, time_max_period=100.0,
                      random_grid_offset=True)
    model_dir, printed = str(root / "run"), []
    train = TrainConfig(model_dir=model_dir, num_train_steps=3, eval_every=2, eval_num_steps=(2,),
                        eval_solves=("rk4:steps=3", "adaptive:rtol=1e-2"))
    result = Trainer(
        model_config=cfg, data_config=data, train_config=train,
        step_config=step_lib.StepConfig(terms=(RandomSteps(choices=(2, 3)),
                                               KineticEnergy(weight=0.5))),
        devices=jax.devices()[:1], config_record=_Record(_operative_gin(data)),
        print_fn=printed.append).run()
    return model_dir, result, printed


def _tiny_data(root):
    from ode_lm.data import DataConfig

    return DataConfig(data_dir=str(root / "data"), tokenizer="bytes", seq_len=16,
                      global_batch_size=8, holdout_fraction=0.05, eval_max_batches=2)


@pytest.fixture(scope="module")
def tiny_run(tiny_trained):
    return tiny_trained[0]


class _Record(GinRecord):
    """A fixed operative config (what the gin CLI hands the trainer)."""

    def __init__(self, text: str):
        self._text = text

    def text(self) -> str:
        return self._text


@pytest.fixture(scope="module")
def tiny_baselines(tiny_run):
    """Sequential baselines of 1 and 2 layers, the ODE run's width and data, 3 steps each."""
    import pathlib

    from ode_lm.training.trainer import TrainConfig, Trainer

    root = pathlib.Path(tiny_run).parent
    data = _tiny_data(root)
    dirs = []
    for layers in (1, 2):
        model_dir = str(root / f"L{layers}")
        Trainer(model_config=tiny_config(vocab_size=384, architecture="sequential",
                                         num_layers=layers),
                data_config=data, train_config=TrainConfig(model_dir=model_dir,
                                                           num_train_steps=3),
                devices=jax.devices()[:1], config_record=_Record(_operative_gin(data)),
                print_fn=lambda _: None).run()
        dirs.append(model_dir)
    return dirs


def _operative_gin(data) -> str:
    """What the gin CLI would write: the data settings the eval reads back."""
    return "\n".join([f"DataConfig.data_dir = {data.data_dir!r}",
                      f"DataConfig.tokenizer = {data.tokenizer!r}",
                      f"DataConfig.seq_len = {data.seq_len}",
                      f"DataConfig.global_batch_size = {data.global_batch_size}",
                      f"DataConfig.holdout_fraction = {data.holdout_fraction}",
                      f"DataConfig.eval_max_batches = {data.eval_max_batches}"])


@pytest.mark.slow
def test_depth_report_end_to_end(tiny_run, tmp_path, capsys):
    from ode_lm.commands import depth_report as tool

    out = tmp_path / "report"
    rc = tool.main([f"--model_dir={tiny_run}", f"--compare_dir={tiny_run}", f"--out={out}",
                    f"--json={tmp_path / 'r.json'}", "--num_steps=1,2",
                    "--solvers=euler,rk4", "--rtols=1e-2,1e-3"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["trained_num_steps"] == 3
    assert set(report["ppl"]) == {"euler", "rk4"} and set(report["ppl"]["rk4"]) == {"1", "2"}
    assert all(v > 1.0 for row in report["ppl"].values() for v in row.values())
    assert [a["rtol"] for a in report["adaptive"]] == [1e-2, 1e-3]
    assert all(a["nfe"] >= 4 and a["ppl"] > 1.0 for a in report["adaptive"])
    assert report["smoothness"] > 0 and report["compare"]["ppl"] == report["ppl"]
    rows = list(csv.DictReader(open(out / "depth_report.csv")))
    assert len(rows) == 2 * (2 * 2 + 2)
    assert (out / "depth_report.png").read_bytes()[:4] == b"\x89PNG"
    assert tool.main([f"--model_dir={tmp_path / 'nope'}", f"--out={out}"]) == 1
    assert "--model_dir=" in capsys.readouterr().err


@pytest.mark.slow
def test_depth_report_frontier_against_baselines(tiny_run, tiny_baselines, tmp_path, capsys):
    """--baselines: frontier.csv holds every ODE setting and each baseline, priced in NFE and
    in forward FLOPs per token as models.accounting counts them; frontier.png is written."""
    from ode_lm.commands import depth_report as tool
    from ode_lm.commands.eval import evaluate_run
    from ode_lm.models.accounting import flops_per_token
    from ode_lm.training.saved_run import load_run

    out = tmp_path / "report"
    rc = tool.main([f"--model_dir={tiny_run}", f"--out={out}", "--num_steps=1,2",
                    "--solvers=euler", "--rtols=1e-2", f"--baselines={','.join(tiny_baselines)}"])
    assert rc == 0, capsys.readouterr().err
    rows = list(csv.DictReader(open(out / "frontier.csv")))
    assert [(r["kind"], r["solver"], r["num_steps"], r["rtol"], r["layers"]) for r in rows] == [
        ("ode", "euler", "1", "", ""), ("ode", "euler", "2", "", ""),
        ("ode", "adaptive", "", "0.01", ""), ("baseline", "", "", "", "1"),
        ("baseline", "", "", "", "2")]
    ode, base = load_run(tiny_run), load_run(tiny_baselines[1])
    data = ode.data_config
    batch_tokens = data.eval_global_batch_size * data.seq_len
    for row, config, n in ((rows[1], ode.config, 2), (rows[4], base.config, None)):
        want = flops_per_token(config, n, solver="euler", seq_len=data.seq_len,
                               tokens_per_batch=batch_tokens)
        assert float(row["nfe"]) == want.evaluations == 2
        assert float(row["flops_per_token"]) == pytest.approx(want.forward, rel=1e-5)  # %.6g
    base_ppl = evaluate_run(tiny_baselines[1])["eval/perplexity"]
    assert float(rows[4]["perplexity"]) == pytest.approx(base_ppl, rel=1e-5)
    ppl = [float(r["perplexity"]) for r in rows]
    nfe = [float(r["nfe"]) for r in rows]
    for r, p, c in zip(rows, ppl, nfe, strict=True):  # nothing cheaper and better
        dominated = any(c2 <= c and p2 < p for p2, c2 in zip(ppl, nfe, strict=True))
        assert r["frontier_nfe"] == str(not dominated)
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "depth_report.json").read_text())
    assert set(report["baselines"]) == {"L1", "L2"}
    assert report["baselines"]["L2"]["num_layers"] == 2
    assert "| 2 | " in capsys.readouterr().out  # the table: baseline L=2 against Euler N=2
    assert tool.main([f"--model_dir={tiny_run}", f"--out={out}",
                      f"--baselines={tiny_run}"]) == 1
    assert "an ODE run, not a discrete baseline" in capsys.readouterr().err
    assert tool.main([f"--model_dir={tiny_run}", f"--out={out}",
                      f"--baselines={tmp_path / 'nope'}"]) == 1
    assert "--baselines=" in capsys.readouterr().err


def test_eval_cli_adaptive_prints_perplexity_and_nfe(tiny_run, capsys):
    from ode_lm.commands.eval import main

    assert main([f"--model_dir={tiny_run}", "--solver=adaptive", "--rtol=1e-3"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["eval/perplexity@adaptive:rtol=0.001"] > 1.0
    assert results["eval/nfe@adaptive:rtol=0.001"] >= 4
    assert main([f"--model_dir={tiny_run}", "--solver=adaptive", "--rtol=-1"]) == 1
    assert "--rtol=-1" in capsys.readouterr().err


def test_final_eval_names_each_setting_and_the_summary_tables_them(tiny_trained, capsys):
    """TrainConfig.eval_solves beside the depth sweep: every figure named by its solver and N
    (plain only at the run's own), and ode_lm.commands.train's summary shows them as one table."""
    from ode_lm.commands.train import report

    _, result, _ = tiny_trained
    ev = result.eval
    assert {k for k in ev if k.startswith("eval/perplexity")} == {
        "eval/perplexity", "eval/perplexity@steps=2", "eval/perplexity@rk4:steps=3",
        "eval/perplexity@adaptive:rtol=0.01"}
    assert (ev["eval/nfe"], ev["eval/nfe@steps=2"], ev["eval/nfe@rk4:steps=3"]) == (3, 2, 12)
    assert ev["eval/nfe@adaptive:rtol=0.01"] >= 4  # at least one bosh3 step (FSAL: 3 + 1)
    assert report(result) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("one set of weights"))
    rows = [line.split() for line in out[start + 1:]]
    assert [r[:2] for r in rows] == [["euler", "N=2"], ["euler", "N=3"], ["rk4", "N=3"],
                                     ["adaptive", "rtol=0.01"]]
    assert float(rows[1][2]) == pytest.approx(ev["eval/perplexity"], abs=0.051)
    assert rows[0][3] == f"{ev['eval/depth_gap/steps=2']:+.1%}"  # each other row: its gap
    assert rows[1][3] == "(the"
    assert "(the run's own N)" in out[start + 2] and "mean NFE" in out[start + 4]
    assert f"eval/loss: {ev['eval/loss']:.4f}" in out
    assert not any(line.startswith(("eval/perplexity", "eval/nfe", "eval/depth_gap"))
                   for line in out)


def test_every_eval_logs_the_depth_gap_equal_to_ode_lm_eval(tiny_trained):
    """eval/depth_gap/<setting> at every eval (in the loop and the final) in metrics.jsonl,
    TensorBoard and the printed eval row; at the last step it is the ratio of what
    ``ode-lm eval`` reports on the saved checkpoint for the same settings, minus one."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ode_lm.commands.eval import evaluate_run

    model_dir, result, printed = tiny_trained
    names = {"eval/depth_gap/steps=2", "eval/depth_gap/rk4:steps=3",
             "eval/depth_gap/adaptive:rtol=0.01"}
    rows = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    evals = [r for r in rows if "eval/perplexity" in r]
    assert [r["step"] for r in evals] == [2, 3]
    assert all(names <= set(r) for r in evals)
    acc = EventAccumulator(model_dir)
    acc.Reload()
    assert all([e.step for e in acc.Scalars(n)] == [2, 3] for n in names)
    own = evaluate_run(model_dir)["eval/perplexity"]
    direct = {"steps=2": evaluate_run(model_dir, (2,))["eval/perplexity@steps=2"],
              "rk4:steps=3": evaluate_run(model_dir, (3,), "rk4")["eval/perplexity@rk4:steps=3"],
              "adaptive:rtol=0.01": evaluate_run(model_dir, solver="adaptive", rtol=1e-2)[
                  "eval/perplexity@adaptive:rtol=0.01"]}
    for setting, ppl in direct.items():
        # float32 losses (eps 1.2e-7) summed over a few hundred tokens: 1e-5 relative
        assert result.eval[f"eval/depth_gap/{setting}"] == pytest.approx(ppl / own - 1, abs=1e-5)
        assert evals[-1][f"eval/depth_gap/{setting}"] == pytest.approx(ppl / own - 1, abs=1e-5)
    eval_rows = [line for line in printed if line.startswith("eval @ step")]
    assert len(eval_rows) == 2 and all("depth gap" in line for line in eval_rows)
    gaps = {s: result.eval[f"eval/depth_gap/{s}"] for s in direct}
    worst = max(gaps, key=lambda s: abs(gaps[s]))
    assert eval_rows[-1].endswith(f"| depth gap {gaps[worst]:+.1%} at {worst} (max of 3)")
    assert not any("eval/depth_gap" in line for line in eval_rows)  # compact: one figure
