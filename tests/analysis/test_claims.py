"""The claims suite's logic on fixed inputs: verdicts (holds / does not hold / inconclusive),
Spearman's ρ, claim selection, run keys, and runs recorded once and reused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ode_lm.claims import suite
from ode_lm.claims.report import format_table
from ode_lm.claims.runs import Runs, RunSpec
from ode_lm.claims.statistics import spearman
from ode_lm.claims.verdict import (
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    NOT_RUN,
    Threshold,
    judge,
)

AT_MOST_2 = Threshold("<=", 2.0, " %")
AT_LEAST_HALF = Threshold(">=", 0.5)


@pytest.mark.parametrize("values, threshold, verdict", [
    ([0.5, 1.9, -3.0], AT_MOST_2, HOLDS),
    ([2.0, 2.0], AT_MOST_2, HOLDS),  # on the threshold is on the claimed side
    ([2.1, 5.0, 9.0], AT_MOST_2, DOES_NOT_HOLD),
    ([1.0, 2.5], AT_MOST_2, INCONCLUSIVE),  # the seeds straddle the threshold
    ([0.9, 0.6], AT_LEAST_HALF, HOLDS),
    ([0.1, -0.4], AT_LEAST_HALF, DOES_NOT_HOLD),
    ([0.4, 0.6, 0.7], AT_LEAST_HALF, INCONCLUSIVE),
    ([math.nan, 0.9], AT_LEAST_HALF, INCONCLUSIVE),  # a failed statistic decides nothing
    ([math.nan, 0.1], AT_LEAST_HALF, INCONCLUSIVE),
    ([], AT_LEAST_HALF, NOT_RUN),
])
def test_verdicts(values, threshold, verdict):
    v = judge(values, threshold)
    assert v.verdict == verdict
    assert v.values == tuple(values)
    finite = [x for x in values if math.isfinite(x)]
    if finite:
        assert (v.low, v.high) == (min(finite), max(finite))
        assert v.mean == pytest.approx(sum(finite) / len(finite), rel=1e-12)


def test_threshold_refuses_nonsense():
    with pytest.raises(ValueError, match="side"):
        Threshold("<", 1.0)
    with pytest.raises(ValueError, match="finite"):
        Threshold("<=", math.nan)


def test_spearman():
    x = np.arange(10.0)
    assert spearman(x, x**3) == pytest.approx(1.0, abs=1e-12)  # monotone: ρ = 1
    assert spearman(x, -np.exp(x)) == pytest.approx(-1.0, abs=1e-12)
    assert spearman(np.array([1.0, 2, 2, 3]), np.array([1.0, 2, 3, 4])) == pytest.approx(
        np.corrcoef([0, 1.5, 1.5, 3], [0, 1, 2, 3])[0, 1], abs=1e-12)  # ties: mean rank
    assert math.isnan(spearman(x, np.ones(10)))


def test_claims_are_unique_and_selectable():
    ids = [c.id for c in suite.CLAIMS]
    assert len(ids) == len(set(ids))
    assert [c.id for c in suite.select(["finetune-own-n-*"])] == [
        "finetune-own-n-no-worse-full", "finetune-own-n-no-worse-lora"]
    assert suite.select(None) == suite.CLAIMS
    with pytest.raises(ValueError, match="--claims=nope: no such claim"):
        suite.select(["nope"])


def test_run_keys_follow_settings():
    a = RunSpec("x", ("runs/demo.gin",), ("TRAIN_STEPS = 3",), seed=0)
    assert a.key == RunSpec("x", ("runs/demo.gin",), ("TRAIN_STEPS = 3",), seed=0).key
    assert a.key != RunSpec("x", ("runs/demo.gin",), ("TRAIN_STEPS = 4",), seed=0).key
    assert a.key != RunSpec("x", ("runs/demo.gin",), ("TRAIN_STEPS = 3",), seed=1).key
    ft = RunSpec("f", ("claims/finetune.gin",), kind="finetune", pretrained=a)
    assert ft.key != RunSpec("f", ("claims/finetune.gin",), kind="finetune",
                             pretrained=RunSpec("x", ("runs/demo.gin",), seed=1)).key
    with pytest.raises(ValueError, match="needs a pretrained run"):
        RunSpec("f", ("claims/finetune.gin",), kind="finetune")


def test_runs_are_recorded_once_and_an_interrupted_suite_continues(tmp_path):
    trained = []

    def train(spec, model_dir, extra):
        if spec.name == "boom":
            raise KeyboardInterrupt("stopped")
        trained.append((spec.name, spec.seed, tuple(extra)))
        return {"step": 1, "eval": {"eval/perplexity": 10.0 + spec.seed}}

    pre = RunSpec("pre", ("runs/demo.gin",), seed=1)
    ft = RunSpec("ft", ("claims/finetune.gin",), seed=1, kind="finetune", pretrained=pre)
    runs = Runs(str(tmp_path), train_fn=train)
    rec = runs.get(ft)  # the pretrained run first, then the fine-tune from its directory
    assert [t[0] for t in trained] == ["pre", "ft"]
    assert trained[1][2] == (f"PRETRAINED_DIR = {pre.directory(str(tmp_path))!r}",)
    assert rec["model_dir"] == ft.directory(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        runs.get(RunSpec("boom", ("runs/demo.gin",)))
    again = Runs(str(tmp_path), train_fn=train)  # a new process: everything recorded is reused
    assert again.get(ft) == rec and again.get(pre)["eval"]["eval/perplexity"] == 11.0
    assert len(trained) == 2 and again.trained == []
    assert again.stat(pre, "s", lambda d: {"dir": d}) == {"dir": pre.directory(str(tmp_path))}
    assert Runs(str(tmp_path), train_fn=train).records[next(
        k for k in again.records if k.startswith("pre-"))]["stats"]["s"]["dir"] == \
        pre.directory(str(tmp_path))


def test_table_has_a_row_per_claim():
    row = {"id": "c", "group": "G", "statistic": "s", "values": [1.0, 2.5],
           "threshold": {"side": "<=", "value": 2.0, "unit": " %"}, "verdict": INCONCLUSIVE}
    text = format_table({"claims": [row, {**row, "id": "d", "group": "H"}]})
    assert "| `c` | s | <= 2 % | +1.00 / +2.50 | **inconclusive** |" in text
    assert text.count("**G**") == 1 and text.count("**H**") == 1
