"""MFU peak table, clu aggregation, the TF-free TensorBoard writer read back, progress line."""

import json
import math

import jax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ode_lm.training import metrics


def test_peak_table_covers_accelerators_and_cpu():
    assert metrics.peak_flops_per_device("TPU v4") == 275e12
    assert metrics.peak_flops_per_device("TPU v5 lite") == 197e12
    assert metrics.peak_flops_per_device("TPU v5p") == 459e12
    assert metrics.peak_flops_per_device("TPU v6 lite") == 918e12
    assert metrics.peak_flops_per_device("NVIDIA A100-SXM4-80GB") == 312e12
    assert metrics.peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.peak_flops_per_device("NVIDIA H200", "float32") == 494e12
    assert metrics.peak_flops_per_device("mystery chip") is None
    cpus = jax.devices("cpu")
    assert metrics.total_peak_flops(cpus, "float32", 123e9) == 123e9  # shared host, per process
    assert metrics.mfu(1e6, 1e5, 1e12) == pytest.approx(0.1)


def test_clu_window_average_and_last_value():
    w = None
    for loss, lr, n in [(2.0, 0.1, 4), (4.0, 0.2, 8)]:
        w = metrics.accumulate(w, dict(loss=loss, grad_norm=1.0, param_norm=3.0,
                                       learning_rate=lr, skipped_steps=0, num_steps=n,
                                       kinetic_energy=loss / 10))
    values = metrics.compute(w)
    assert float(values["loss"]) == pytest.approx(3.0)
    assert float(values["learning_rate"]) == pytest.approx(0.2)
    assert float(values["num_steps"]) == pytest.approx(6.0)  # mean N of the window
    assert float(values["kinetic_energy"]) == pytest.approx(0.3)


def test_tf_free_writer_event_files_read_back(tmp_path):
    writer = metrics.create_writer(str(tmp_path), process_index=0)
    writer.write_scalars(1, {"train/loss": 3.5, "eval/perplexity@steps=4": 20.0})
    writer.write_scalars(2, {"train/loss": 3.0})
    writer.write_texts(0, {"config": "TrainConfig.seed = 0"})
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [3.5, 3.0]
    assert acc.Scalars("eval/perplexity@steps=4")[0].step == 1  # tag kept verbatim
    assert acc.Tensors("config")[0].tensor_proto.string_val == [b"TrainConfig.seed = 0"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "train/loss": 3.5, "eval/perplexity@steps=4": 20.0}
    other = metrics.create_writer(str(tmp_path / "other"), process_index=1)  # not process 0
    other.write_scalars(1, {"train/loss": 1.0})
    other.write_texts(1, {"config": "x"})
    other.flush()
    other.close()
    assert not (tmp_path / "other").exists()  # writes nothing, anywhere


def test_progress_line():
    line = metrics.progress_line(120, 600, 4.2131, 12345.0, 0.231, 92.0)
    assert line == "step 120/600 | loss 4.2131 | 12.3k tok/s | MFU 23.1% | ETA 1m32s"
    assert "MFU n/a" in metrics.progress_line(1, 2, 1.0, 1.0, math.nan, 1.0)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step_outputs(loss: float) -> dict:
    return dict(loss=loss, grad_norm=1.0, param_norm=3.0, learning_rate=0.1, skipped_steps=0,
                num_steps=2, kinetic_energy=0.0)


def drive(tmp_path, reads, log_steps, total, restart_after=()):
    """Feed (step, read time, steps dispatched) reads through a window, as the trainer does;
    the rows written to metrics.jsonl and the progress lines."""
    clock = FakeClock()
    window = metrics.MetricWindow(tokens_per_step=1000, flops_per_token=6e3, peak_flops=1e9,
                                  total_steps=total, clock=clock)
    writer = metrics.create_writer(str(tmp_path), process_index=0)
    lines = []
    for step, at, dispatched in reads:
        clock.now = at
        window.add(step_outputs(float(step)), dispatched=dispatched)
        if step in log_steps:
            lines.append(window.log(step, writer))
        if step in restart_after:
            window.restart()
    writer.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rows, lines


def test_window_throughput_over_timed_steps_only(tmp_path):
    """log_every=3, 7 steps: step k is read after step k+1 is dispatched; the first read only
    starts the clock, the drained last one (nothing dispatched since) times nothing."""
    reads = [(1, 110.0, 2), (2, 111.0, 3), (3, 112.0, 4),  # step 1's interval: the compile
             (4, 113.5, 5), (5, 115.0, 6), (6, 116.5, 7),
             (7, 116.6, 7)]  # drained right after step 6's read: 0.1 s is not a step
    rows, lines = drive(tmp_path, reads, {3, 6, 7}, total=7)
    assert [r["step"] for r in rows] == [3, 6, 7]
    assert rows[0]["train/step_time"] == pytest.approx(1.0)  # steps 2, 3 timed
    assert rows[0]["train/tokens_per_second"] == pytest.approx(1000.0)
    assert rows[0]["train/mfu"] == pytest.approx(6e3 * 1000.0 / 1e9)
    assert rows[0]["train/loss"] == pytest.approx(2.0)  # loss averages all 3 steps
    assert rows[1]["train/step_time"] == pytest.approx(1.5)  # steps 4, 5, 6
    assert rows[1]["train/tokens_per_second"] == pytest.approx(1000.0 / 1.5)
    # the last, partial window: loss and tokens seen, no throughput
    assert rows[2]["train/loss"] == 7.0 and rows[2]["train/tokens_seen"] == 7000
    assert not {"train/tokens_per_second", "train/step_time", "train/mfu"} & set(rows[2])
    assert lines[0] == "step 3/7 | loss 2.0000 | 1.0k tok/s | MFU 0.6% | ETA 4s"  # 4 x 1 s
    assert lines[1].endswith("0.7k tok/s | MFU 0.4% | ETA 1s")  # 1 x (6.5 s / 5 timed steps)
    assert lines[2] == "step 7/7 | loss 7.0000 | n/a tok/s | MFU n/a | ETA 0s"


def test_window_single_step_run_writes_no_throughput(tmp_path):
    rows, lines = drive(tmp_path, [(1, 5.0, 1)], {1}, total=1)
    assert rows == [{"step": 1, "train/loss": 1.0, "train/grad_norm": 1.0,
                     "train/param_norm": 3.0, "train/learning_rate": pytest.approx(0.1),
                     "train/skipped_steps": 0.0, "train/num_steps": 2.0,
                     "train/kinetic_energy": 0.0, "train/tokens_seen": 1000}]
    assert lines == ["step 1/1 | loss 1.0000 | n/a tok/s | MFU n/a | ETA 0s"]


def test_window_around_checkpoints_and_evals(tmp_path):
    """Step 2 is read at once for its checkpoint (nothing dispatched since step 1's read),
    then an eval; step 3's read (2 dispatches later) and the eval time nothing. With a save
    every step (steps 5, 6 read right after their own dispatch) each interval is one step."""
    reads = [(1, 10.0, 2), (2, 10.2, 2), (3, 50.0, 4), (4, 51.0, 5), (5, 52.0, 5),
             (6, 54.0, 6), (7, 54.1, 6)]
    rows, lines = drive(tmp_path, reads, {1, 2, 3, 4, 5, 6, 7}, total=7, restart_after={2})
    timed = {r["step"]: r["train/step_time"] for r in rows if "train/step_time" in r}
    assert timed == {4: pytest.approx(1.0), 6: pytest.approx(2.0)}
    assert "ETA ?" in lines[0] and "ETA 3s" in lines[3]  # 3 x 1 s
    # without the restart after the eval, step 3's read is still not timed (2 dispatches)
    rows, _ = drive(tmp_path / "no_restart", reads[:3], {3}, total=7)
    assert "train/step_time" not in rows[0]


class _Window:
    """Records what the reader hands to a MetricWindow."""

    def __init__(self):
        self.added, self.logged = [], []

    def add(self, outputs, *, dispatched):
        self.added.append((float(outputs["loss"]), dispatched))

    def log(self, step, writer, extra=None):
        self.logged.append(step)
        return f"line {step}"


def test_step_reader_reads_one_step_late_and_drains_before_saves():
    import numpy as np

    from ode_lm.training.hooks import Hooks, StepInfo, StepReader

    window, lines = _Window(), []
    reader = StepReader(window, None, lines.append, max_bad_steps=2)
    hooks = Hooks()  # as the trainer registers them: read every step, log every 2nd
    hooks.add(reader.read, every=1)
    hooks.add(reader.log, every=2)

    def step(n, loss, bad=0):
        hooks.run(StepInfo(n, 3, None, {"loss": np.float32(loss), "bad_streak": np.int32(bad)}))

    step(1, 5.0)
    assert window.added == []  # step 1 is held while step 2 would run
    step(2, 4.0)
    assert window.added == [(5.0, 2)]  # read when step 2 was dispatched
    reader.drain(dispatched=2)  # e.g. before a checkpoint of step 2
    reader.drain(dispatched=2)  # nothing held: no second read
    step(3, 3.0)
    reader.drain(dispatched=3)
    assert window.added == [(5.0, 2), (4.0, 2), (3.0, 3)]
    assert window.logged == [2, 3] and lines == ["line 2", "line 3"]  # interval + last step
    assert (reader.first_loss, reader.last_loss) == (5.0, 3.0)
    reader.push(4, {"loss": np.float32(float("nan")), "bad_streak": np.int32(2)})
    with pytest.raises(FloatingPointError, match=r"2 consecutive steps .* \(last at step 4\)"):
        reader.drain(dispatched=4)


def test_eval_names_are_one_scheme_for_trainer_and_eval_cli(monkeypatch):
    """No suffix at the model's own N (None or N itself, evaluated once), @steps=M for the
    others, @<solver>:rtol=<r> for an adaptive solver (once, whatever the N list)."""
    from ode_lm.training import evaluation, metric_names
    from ode_lm.training.step import EvalResult

    calls = []

    def fake_result(self, params, solve):
        calls.append((solve.num_steps, solve.solver, solve.rtol))
        return EvalResult(loss=float(solve.num_steps or 4), tokens=10.0, nfe=1.0)

    monkeypatch.setattr(evaluation.Evaluator, "result", fake_result)
    ev = evaluation.Evaluator(None, lambda: [], model_num_steps=4, model_rtol=1e-3)
    res = ev.sweep("params", (None, 2, 4, 8))
    assert calls == [(None, None, None), (2, None, None), (8, None, None)]
    assert res == {"eval/loss": 4.0, "eval/perplexity": math.exp(4.0), "eval/nfe": 1.0,
                   "eval/tokens": 10.0,
                   "eval/loss@steps=2": 2.0, "eval/perplexity@steps=2": math.exp(2.0),
                   "eval/nfe@steps=2": 1.0,
                   "eval/loss@steps=8": 8.0, "eval/perplexity@steps=8": math.exp(8.0),
                   "eval/nfe@steps=8": 1.0}
    assert set(ev.sweep("params", (2, 8), "dopri5")) == {
        "eval/loss@dopri5:rtol=0.001", "eval/perplexity@dopri5:rtol=0.001",
        "eval/nfe@dopri5:rtol=0.001", "eval/tokens"}
    assert metric_names.metric_suffix(3, 4, "adaptive", 1e-2) == "@adaptive:rtol=0.01"


def test_metric_suffix_names_the_solver_unless_it_is_the_runs_own():
    """One function names every eval figure: plain only at the run's own solver and N."""
    from ode_lm.models.solve import Solve
    from ode_lm.training.evaluation import Evaluator
    from ode_lm.training.metric_names import metric_suffix

    def name(n, solver=None, rtol=None):
        return metric_suffix(n, 6, solver, rtol, model_solver="euler")

    assert name(None) == name(6) == name(6, "euler") == ""
    assert name(4) == name(4, "euler") == "@steps=4"  # the TensorBoard names of today
    assert name(6, "rk4") == name(None, "rk4") == "@rk4:steps=6"
    assert name(4, "midpoint") == "@midpoint:steps=4"
    assert name(None, "adaptive", 1e-3) == name(8, "adaptive", 1e-3) == "@adaptive:rtol=0.001"
    # the words after '@' are the setting, read back by Solve.parse (TrainConfig.eval_solves)
    for words in ("rk4:steps=6", "midpoint:steps=2", "adaptive:rtol=0.001", "dopri5:rtol=1e-05"):
        s = Solve.parse(words)
        assert name(s.num_steps, s.solver, s.rtol) == "@" + words
    assert Solve.parse("steps=4") == Solve(None, 4) and Solve.parse("euler:steps=3").num_steps == 3
    for words in ("rk4:steps=6", "steps=4", "adaptive:rtol=0.001"):  # the one printer
        assert str(Solve.parse(words)) == words
    for bad, message in (("rk4:step=8", "expected '<solver>:steps=<N>'"),
                         ("adaptive:steps=8", "expected"),
                         ("steps=x", "'x' is not a whole number of steps"),
                         ("rk5:steps=8", "solver 'rk5' is not one of"),
                         ("euler:steps=0", "steps must be > 0"),
                         ("adaptive:rtol=-1", "rtol must be > 0")):
        with pytest.raises(ValueError, match=f"^flag={bad!r}: {message}"):
            Solve.parse(bad, "flag")
    ev = Evaluator(None, lambda: [], model_num_steps=6, model_solver="euler", model_rtol=1e-3)
    settings = ev.settings([Solve(), Solve("euler", 6), Solve(None, 4), Solve("rk4", 6),
                            Solve("adaptive")])
    assert settings == {"": Solve("euler", 6), "@steps=4": Solve("euler", 4),
                        "@rk4:steps=6": Solve("rk4", 6),
                        "@adaptive:rtol=0.001": Solve("adaptive", rtol=1e-3)}


def test_metric_names_read_back_what_they_write():
    """name -> (metric, setting, eval set) -> the same name, for every kind of figure."""
    from ode_lm.models.solve import Solve
    from ode_lm.training.metric_names import MetricName, is_metric, name, parse

    cases = {
        "eval/perplexity": MetricName("perplexity"),
        "eval/loss@steps=4": MetricName("loss", Solve(None, 4)),
        "eval/nfe@rk4:steps=8": MetricName("nfe", Solve("rk4", 8)),
        "eval/perplexity@adaptive:rtol=0.001": MetricName("perplexity",
                                                          Solve("adaptive", rtol=1e-3)),
        "eval/tokens": MetricName("tokens"),
        "eval/even/perplexity@steps=4": MetricName("perplexity", Solve(None, 4), "even"),
        "eval/depth_gap/rk4:steps=8": MetricName("depth_gap", Solve("rk4", 8)),
        "eval/depth_gap/steps=2": MetricName("depth_gap", Solve(None, 2)),
    }
    for key, want in cases.items():
        assert parse(key) == want, key
        assert str(want) == key == name(want.metric, want.suffix, want.eval_set)
    assert parse("train/loss") is None and parse("step") is None
    assert parse("lm_eval/tiny/acc") is None
    assert is_metric("eval/nfe@steps=2", "nfe", "tokens")
    assert not is_metric("eval/even/loss", "nfe") and not is_metric("train/loss", "loss")
    with pytest.raises(ValueError, match="eval/loss@rk5:steps=2"):
        parse("eval/loss@rk5:steps=2")


def test_depth_table_shows_each_setting_once_and_leaves_the_rest():
    from ode_lm.models.solve import Solve
    from ode_lm.training.summary import depth_table

    results = {"eval/loss": 4.6, "eval/perplexity": 100.5, "eval/nfe": 6.0,
               "eval/tokens": 20480.0, "eval/loss@steps=2": 7.8,
               "eval/perplexity@steps=2": 2488.5, "eval/nfe@steps=2": 2.0,
               "eval/loss@adaptive:rtol=0.001": 4.64,
               "eval/perplexity@adaptive:rtol=0.001": 103.7,
               "eval/nfe@adaptive:rtol=0.001": 43.2, "data/unigram_entropy": 6.37}
    settings = {"": Solve("euler", 6), "@adaptive:rtol=0.001": Solve("adaptive", rtol=1e-3),
                "@steps=2": Solve("euler", 2)}
    lines, shown = depth_table(results, settings)
    assert lines[0] == ("one set of weights, solved with N steps "
                        "(validation perplexity over 20,480 tokens):")
    assert [line.split()[:3] for line in lines[1:]] == [
        ["euler", "N=2", "2488.5"], ["euler", "N=6", "100.5"], ["adaptive", "rtol=0.001", "103.7"]]
    assert lines[2].endswith("(the run's own N)") and lines[3].endswith("mean NFE 43.2")
    # the run's own loss and anything else stay lines of their own in the summary
    assert set(results) - shown == {"eval/loss", "data/unigram_entropy"}
    assert depth_table(results, {}) == ([], set())
