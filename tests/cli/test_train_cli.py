"""End-to-end CLI runs of ``python -m ode_lm.commands.train`` as real subprocesses.

One uninterrupted reference run is shared by: exact resume after SIGKILL, SIGTERM
preemption, TensorBoard read-back and the "bad input leaves MODEL_DIR intact" checks.
A persistent XLA compilation cache makes the later runs skip recompiling the same step.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from train_cli_helpers import (
    K,
    assert_same_params,
    checkpoint_steps,
    kill_and_resume,
    losses,
    reference_run,
    run,
    snapshot,
    start,
    write_gin,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_cli")


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    """An uninterrupted 2K-step run."""
    model_dir, out = reference_run(workdir)
    assert f"steps: {2 * K}" in out and "eval/perplexity" in out
    return model_dir


def test_reference_run_writes_config_checkpoints_and_tensorboard(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert checkpoint_steps(reference)[-1] == 2 * K
    config = (reference / "config.gin").read_text()
    assert "D_MODEL = 32" in config and "ModelConfig.d_model = %D_MODEL" in config
    assert "TRAIN_STEPS = 8" in config and "TrainConfig.log_every = 1" in config
    assert json.loads((reference / "model_config.json").read_text())["d_model"] == 32
    data = json.loads((reference / "data_config.json").read_text())
    assert data["data_dir"] == str(reference.parent / "data") and data["tokenizer"] == "bytes"
    assert (data["seq_len"], data["global_batch_size"], data["eval_max_batches"]) == (32, 8, 2)
    acc = EventAccumulator(str(reference))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in ("loss", "learning_rate", "grad_norm", "param_norm", "tokens_per_second",
                 "tokens_seen", "step_time", "mfu", "num_steps", "kinetic_energy"):
        assert f"train/{name}" in tags, (name, sorted(tags))
    for name in ("eval/loss", "eval/perplexity", "eval/loss@steps=4", "eval/perplexity@steps=4"):
        assert name in tags, (name, sorted(tags))
    assert len(acc.Scalars("train/loss")) == 2 * K
    drawn = [e.value for e in acc.Scalars("train/num_steps")]  # log_every = 1: each step's N
    assert set(drawn) <= {1.0, 2.0, 3.0} and len(set(drawn)) > 1, drawn
    assert all(e.value > 0 for e in acc.Scalars("train/kinetic_energy"))
    assert acc.Scalars("train/tokens_seen")[-1].value == 2 * K * 8 * 32
    assert "config" in " ".join(acc.Tags()["tensors"])  # operative config as text


def test_old_run_without_data_config_loads_through_its_config_gin(reference, tmp_path):
    """A run from before data_config.json: the one fallback reads the operative config.gin
    and gives the same DataConfig, so eval sees the same data."""
    import shutil

    from ode_lm.gin_setup import run_dir
    from ode_lm.training.run_dir import RunDir
    from ode_lm.training.saved_run import load_run

    old = tmp_path / "old"
    shutil.copytree(reference, old)
    (old / "data_config.json").unlink()
    assert RunDir(str(old)).data_config() is None  # the gin layer's reader reads config.gin
    assert run_dir(str(old)).data_config() == RunDir(str(reference)).data_config()
    run = load_run(str(old), read_run=run_dir)
    assert run.data_config == RunDir(str(reference)).data_config() and run.step == 2 * K


def test_exact_resume_after_sigkill(workdir, reference):
    kill_and_resume(workdir, reference)


def test_sigterm_saves_exits_zero_and_next_run_continues(workdir, reference):
    model_dir = workdir / "preempted"
    gin_file = write_gin(workdir, "preempted", model_dir)
    proc = start(workdir, gin_file)
    deadline = time.time() + 600
    while not checkpoint_steps(model_dir) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM" in out
    stopped = checkpoint_steps(model_dir)[-1]
    assert stopped < 2 * K, "SIGTERM arrived too late to test anything"
    rc, out, err = run(workdir, gin_file)
    assert rc == 0, err[-3000:]
    assert f"resumed from step {stopped}" in out
    assert losses(model_dir) == losses(reference)
    assert_same_params(reference, model_dir)


BAD_INPUTS = {
    "bad gin file": ([], "ModelConfig.d_model = = 3\n", "ModelConfig.d_model"),
    "unknown binding": (["--gin.ModelConfig.d_modle=64"], "", "d_modle"),
    "mesh not dividing devices": (["--gin.MeshConfig.ici_parallelism=(3, -1, 1)"], "",
                                  "does not divide the device count 8"),
    "batch not divisible": (["--gin.BATCH_SIZE=6"], "", "global_batch_size=6 is not divisible"),
    "sequence too long": (["--gin.DataConfig.seq_len=64"], "", "exceeds the model's positions"),
    "unwritable model dir": (["--gin.MODEL_DIR=/dev/null/run"], "", "is not writable"),
    "changed model shape": (["--gin.D_MODEL=64"], "", "block/"),
}


CROSS_CONFIG = {"batch not divisible", "sequence too long"}  # two configs' settings


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_line_error_and_model_dir_untouched(case, workdir, reference, capsys):
    from ode_lm.commands.train import main

    extra, gin_tail, expected = BAD_INPUTS[case]
    gin_file = write_gin(workdir, "bad_" + case.replace(" ", "_"), reference)
    gin_file.write_text(gin_file.read_text() + gin_tail)
    before = snapshot(reference)
    rc = main([f"--gin_file={gin_file}", *extra])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    if case in CROSS_CONFIG:  # settings that do not fit together: refused like one field
        assert rc == 2, (rc, err)
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ode-lm-train: error:") and expected in err, err
    assert snapshot(reference) == before


def test_changed_shape_error_names_parameter_and_both_shapes(workdir, reference, capsys):
    from ode_lm.commands.train import main

    gin_file = write_gin(workdir, "changed_width", reference)
    assert main([f"--gin_file={gin_file}", "--gin.NUM_HEADS=4", "--gin.D_MODEL=64"]) == 1
    err = capsys.readouterr().err
    assert "has shape (" in err and "but the configured model wants (" in err, err


def test_eval_cli_matches_training_eval_and_sweeps_depth(reference, capsys):
    from ode_lm.commands.eval import main

    rows = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    final_eval = [r for r in rows if "eval/loss" in r][-1]
    assert main([f"--model_dir={reference}", "--num_steps=2,4", "--solver=euler"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["step"] == 2 * K
    # one naming in both: no suffix at the model's own N=2 (asked for as 2), @steps=M else
    assert set(results) == set(final_eval), (results, final_eval)
    # same checkpoint, same eval step, another process: float32 losses ~5 (ulp 4.8e-7); 1e-5
    # is ~20 ulps, room for a differently fused program, far below any real change
    assert abs(results["eval/loss"] - final_eval["eval/loss"]) < 1e-5
    assert abs(results["eval/loss@steps=4"] - final_eval["eval/loss@steps=4"]) < 1e-5
    assert results["eval/perplexity"] > 1.0 and results["eval/nfe@steps=4"] == 4.0
    # another solver is named, at the run's own N too: never the trained Euler figure's key
    assert main([f"--model_dir={reference}", "--num_steps=2,4", "--solver=rk4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rk4 = json.loads(out[-1])
    # ... and the run's own solve beside it, so that each setting has its gap to it
    assert set(rk4) == {"step", "eval/tokens", "eval/loss", "eval/perplexity", "eval/nfe"} | {
        f"eval/{m}@rk4:steps={n}" for m in ("loss", "perplexity", "nfe") for n in (2, 4)} | {
        f"eval/depth_gap/rk4:steps={n}" for n in (2, 4)}
    assert rk4["eval/loss"] == pytest.approx(results["eval/loss"], abs=1e-5)
    assert rk4["eval/nfe@rk4:steps=2"] == 8.0 and rk4["eval/tokens"] == results["eval/tokens"]
    assert f"eval/perplexity@rk4:steps=2: {rk4['eval/perplexity@rk4:steps=2']:.4f}" in out
    assert rk4["eval/loss@rk4:steps=2"] != results["eval/loss"]
    assert main([f"--model_dir={reference}", "--solver=rk5"]) == 2  # a bad flag value
    assert "--solver='rk5'" in capsys.readouterr().err
