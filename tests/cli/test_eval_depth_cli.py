"""``ode-lm eval`` and ``ode-lm depth-report`` on a tiny run trained by the real trainer, and
the trainer's own eval figures beside them: every setting named by its solver and N, the
run summary's table, and ``eval/depth_gap/<setting>`` equal to what ``ode-lm eval`` reports."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import jax
import model_helpers
import pytest
from model_helpers import LIVELY

from ode_lm.gin_setup import GinRecord
from ode_lm.models import ModelConfig
from ode_lm.training import step as step_lib
from ode_lm.training.objective import KineticEnergy, RandomSteps


def tiny_config(**kw) -> ModelConfig:
    return model_helpers.tiny_config(LIVELY, max_seq_len=16, **kw)


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
    train = TrainConfig(model_dir=model_dir, num_train_steps=3, eval_every=2,
                        eval_solves=("steps=2", "rk4:steps=3", "adaptive:rtol=1e-2"))
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
    assert report["provenance"]["command"].startswith("ode-lm depth-report --model_dir=")
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
    assert main([f"--model_dir={tiny_run}", "--solver=adaptive", "--rtol=-1"]) == 2  # a flag
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


def test_eval_solves_gaps_and_log_reach_depth_gap(tiny_run, tmp_path, capsys):
    """``--solves`` evaluates several settings in one call, each with its gap to the run's
    own N (evaluated though not asked for); ``--log`` appends the row the trainer would
    write, which ``ode-lm depth-gap table`` reads beside the in-loop evals of that step."""
    import shutil

    from ode_lm.commands import depth_gap
    from ode_lm.commands.eval import main

    run = str(tmp_path / "run")
    shutil.copytree(tiny_run, run)
    before = (Path(run) / "metrics.jsonl").read_text().splitlines()
    assert main([f"--model_dir={run}", "--solves=euler:2,4 rk4:2", "--log"]) == 0
    out = capsys.readouterr().out.splitlines()
    results = json.loads(out[-1])
    assert results["step"] == 3.0 and "eval/perplexity" in results  # the own N, not asked for
    gaps = {k for k in results if k.startswith("eval/depth_gap/")}
    assert gaps == {"eval/depth_gap/steps=2", "eval/depth_gap/steps=4",
                    "eval/depth_gap/rk4:steps=2"}
    own = results["eval/perplexity"]
    assert results["eval/depth_gap/steps=4"] == pytest.approx(
        results["eval/perplexity@steps=4"] / own - 1)
    assert any(line.startswith("steps=4: perplexity ") and "gap " in line for line in out)
    after = (Path(run) / "metrics.jsonl").read_text().splitlines()
    assert after[:len(before)] == before and len(after) == len(before) + 1
    row = json.loads(after[-1])
    assert row == {"step": 3, **{k: v for k, v in results.items() if k != "step"}}
    table = depth_gap.table([("r", run, 3)])
    cells = table.splitlines()[-1].split(" | ")
    assert cells[4].startswith("**") and cells[5] != "–"  # own N=3; N=4 from the logged row
