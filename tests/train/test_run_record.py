"""A run's record stays true: Ctrl-C saves (a second stops at once), a rerun with nothing to
train changes nothing, a resume with new settings keeps each start's config and says so,
metrics past the last checkpoint are dropped on resume, a damaged latest checkpoint is one
line, an adaptive solve that hits its step cap is one line, an export needs its tokenizer.

The CLI cases are real subprocesses of the micro model (``data_helpers.micro_cli_gin``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import terminal
from data_helpers import cli_env, micro_cli_gin, tree_hash

REPO = Path(__file__).resolve().parents[2]
slow = pytest.mark.slow


# ------------------------------------------------------------------------ helpers


def _env(work: Path) -> dict[str, str]:
    return cli_env(work.parent / "xla_cache")


def _cmd(work: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=_env(work),
                          capture_output=True, text=True, timeout=600)


def _start(work: Path, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=_env(work),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _gin(work: Path, name: str, model: Path, steps: int, extra: str = "") -> Path:
    path = work / f"{name}.gin"
    path.write_text(micro_cli_gin(work / "prep", model, train_steps=steps,
                                  ici="(-1, 1, 1)") + extra)
    return path


def _rows(model: Path) -> list[dict]:
    return [json.loads(x) for x in (model / "metrics.jsonl").read_text().splitlines()]


def _ckpt_steps(model: Path) -> list[int]:
    d = model / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run_record") / "w"


@pytest.fixture(scope="module")
def finished(work) -> Path:
    """A finished 3-step micro run (checkpoints 1, 2, 3), its data prepared in work/prep."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "finished"
    gin = _gin(work, "finished", model, 3)
    r = _cmd(work, ["-m", "ode_lm.commands.train", f"--gin_file={gin}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _ckpt_steps(model) == [1, 2, 3]
    return model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------- 2. rerun identity


@slow
def test_nothing_to_train_says_so_and_changes_nothing(work, finished):
    before, data_before = tree_hash(finished), tree_hash(work / "prep")
    r = _cmd(work, ["-m", "ode_lm.commands.train", f"--gin_file={work / 'finished.gin'}",
                    "--gin.ODE_STEPS=8"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _lines(r.stdout) == [
        "nothing to train: MODEL_DIR is at step 3 \u2265 TRAIN_STEPS=3"], r.stdout
    assert _lines(r.stderr) == [], r.stderr
    assert tree_hash(finished) == before  # no events file, config, metrics or lock debris
    assert tree_hash(work / "prep") == data_before


@slow
def test_resume_with_new_settings_keeps_each_config(work, finished):
    model = _copy(finished, work / "changed")
    config_gin = (model / "config.gin").read_bytes()
    gin = _gin(work, "changed", model, 3)
    r = _cmd(work, ["-m", "ode_lm.commands.train", f"--gin_file={gin}", "--gin.ODE_STEPS=4",
                    "--gin.TRAIN_STEPS=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    said = [x for x in r.stdout.splitlines() if x.startswith("settings changed")]
    assert said == ["settings changed at step 3 (config.3.gin): ODE_STEPS 2 \u2192 4, "
                    "TRAIN_STEPS 3 \u2192 4"], r.stdout
    assert (model / "config.gin").read_bytes() == config_gin  # the first start's, kept
    assert "ODE_STEPS = 4" in (model / "config.3.gin").read_text()
    assert json.loads((model / "model_config.json").read_text())["num_steps"] == 4
    assert _ckpt_steps(model)[-1] == 4
    # a rerun of the same command: nothing to train, nothing changes
    before = tree_hash(model)
    r = _cmd(work, ["-m", "ode_lm.commands.train", f"--gin_file={gin}", "--gin.ODE_STEPS=4",
                    "--gin.TRAIN_STEPS=4"])
    assert r.returncode == 0 and tree_hash(model) == before


@slow
def test_resume_with_the_same_terms_or_a_hand_edited_config_is_no_change(work):
    """A list of ``@Term()`` references and a reformatted value compare by value: a plain
    resume keeps no ``config.<step>.gin`` and says nothing of changed settings."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "terms"
    gin = _gin(work, "terms", model, 3, extra=(
        "RandomSteps.choices = (1, 2)\nKineticEnergy.weight = 0.5\n"
        "StepConfig.terms = [@RandomSteps(), @KineticEnergy()]\n"))
    argv = ["-m", "ode_lm.commands.train", f"--gin_file={gin}"]
    first = _cmd(work, argv)
    assert first.returncode == 0, first.stderr[-3000:]
    for edit in (lambda text: text, lambda text: re.sub(
            r"(StepConfig\.terms = )\[(.*)\]", r"\1(\2)", text.replace(
            "KineticEnergy.weight = 0.5", "KineticEnergy.weight = 5e-1"))):
        config = model / "config.gin"
        config.write_text(edit(config.read_text()))
        shutil.rmtree(model / "checkpoints" / "3")  # an interrupted run, resumed at step 2
        r = _cmd(work, argv)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "settings changed" not in r.stdout, r.stdout
        assert sorted(p.name for p in model.glob("config*.gin")) == ["config.gin"]


def _corpus(path: Path, words: list[str], n: int = 300) -> Path:
    import random

    rng = random.Random(len(words))
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=30))}) + "\n"
                            for _ in range(n)))
    return path


@slow
def test_resume_on_another_tokenizer_of_the_same_spec_is_refused(work):
    """``bpe:300`` trained on another corpus is another tokenizer: a resume on it is refused
    in one line (by the run's ``inputs.json``, or by its old data dir's manifest), MODEL_DIR
    left as it was."""
    work.mkdir(parents=True, exist_ok=True)
    a = _corpus(work / "a.jsonl", ["ode", "solver", "euler", "midpoint", "step", "grid"])
    b = _corpus(work / "b.jsonl", ["token", "vocab", "merge", "byte", "pair", "corpus", "x"])
    model = work / "tok"
    gin = work / "tok.gin"
    gin.write_text(micro_cli_gin(work / "tok_a", model, train_steps=2, ici="(-1, 1, 1)")
                   + f"TOKENIZER = 'bpe:300'\nDataConfig.source = '{a}'\n")
    argv = ["-m", "ode_lm.commands.train", f"--gin_file={gin}"]
    r = _cmd(work, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((model / "inputs.json").read_text())["tokenizer"]["spec"] == "bpe:300"
    before = tree_hash(model)
    other = [f"--gin.DataConfig.source='{b}'", "--gin.TRAIN_STEPS=3"]
    cases = {"another data dir": [f"--gin.DATA_DIR='{work / 'tok_b'}'"],
             "the data dir prepared again": []}
    for case, extra in cases.items():
        if not extra:
            shutil.rmtree(work / "tok_a")  # same path, now prepared from another corpus
        r = _cmd(work, [*argv, *other, *extra])
        err = r.stderr.strip()
        assert r.returncode == 1, (case, r.stdout[-2000:], err[-2000:])
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (case, err)
        assert "tokenizer mismatch: MODEL_DIR=" in err and "'bpe:300'" in err, (case, err)
        assert tree_hash(model) == before, case
    # its checkpoints do not evaluate on the data dir prepared again either
    r = _cmd(work, ["-m", "ode_lm", "eval", f"--model_dir={model}"])
    err = r.stderr.strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1, (r.stdout[-2000:], err[-2000:])
    assert err.startswith(f"ode-lm eval: error: tokenizer mismatch: --model_dir={model}"), err
    assert tree_hash(model) == before


@slow
def test_resume_drops_metrics_logged_after_the_checkpoint(work, finished):
    model = _copy(finished, work / "trimmed")
    with open(model / "metrics.jsonl", "a") as f:  # a killed run's rows past checkpoint 3
        f.write(json.dumps({"step": 4, "train/loss": 99.0}) + "\n")
        f.write(json.dumps({"step": 5, "train/loss": 99.0}) + "\n")
        f.write('{"step": 6, "train/lo')  # torn by the kill
    r = _cmd(work, ["-m", "ode_lm.commands.train", f"--gin_file={_gin(work, 'trimmed', model, 4)}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dropped 3 metrics rows logged after step 3" in r.stdout
    train = [(x["step"], x["train/loss"]) for x in _rows(model) if "train/loss" in x]
    assert [s for s, _ in train] == [1, 2, 3, 4] and 99.0 not in [v for _, v in train]


# ------------------------------------------------------------------ 1. Ctrl-C


def _interrupt(work: Path, name: str, presses: int, gap: float = 0.01
               ) -> tuple[subprocess.Popen, str, str, Path]:
    model = work / name
    gin = _gin(work, name, model, 100_000, "CheckpointConfig.save_every = 100_000\n")
    proc = _start(work, ["-m", "ode_lm.commands.train", f"--gin_file={gin}"])
    deadline = time.time() + 300
    while proc.poll() is None:  # a few steps in, none saved on the interval
        assert time.time() < deadline
        if (model / "metrics.jsonl").exists() and len(_rows(model)) >= 3:
            break
        time.sleep(0.05)
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
    out, err = proc.communicate(timeout=300)
    return proc, out, err, model


@slow
def test_ctrl_c_saves_at_the_next_step_and_exits_130(work, finished):
    proc, out, err, model = _interrupt(work, "ctrl_c", 1)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and _lines(err) == [], err
    step = _ckpt_steps(model)[-1]
    assert f"stopped by Ctrl-C after step {step}; checkpoint saved" in _lines(out)[-1]
    assert max(x["step"] for x in _rows(model)) == step  # one timeline, all in a checkpoint
    assert json.loads((model / "model_config.json").read_text())["d_model"] == 32


@slow
def test_second_ctrl_c_stops_at_once_in_one_line(work, finished):
    proc, out, err, model = _interrupt(work, "ctrl_c_twice", 2)
    if not _lines(err) and "stopped by Ctrl-C" in out:
        # Two presses that arrive while the main thread is inside one XLA call reach Python
        # as one signal (CPython runs a handler once per trip); a loaded host makes that
        # likely. That run stopped as for one press: press twice again, further apart.
        proc, out, err, model = _interrupt(work, "ctrl_c_twice_again", 2, gap=0.1)
    assert proc.returncode == 130, err[-3000:]
    lines = _lines(err)
    assert len(lines) == 1 and "Ctrl-C" in lines[0] and "Traceback" not in err, err
    assert not (model / "run.lock").exists()


# Ctrl-C pressed at a given point of the loop: the train CLI run with a hook method wrapped
# to send SIGINT to its own process there (a press timed to the millisecond)
_PRESS = """
import os, signal, sys, time
from ode_lm.training import hooks

def press():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs here, in the main thread

{patch}
from ode_lm.commands import train
sys.exit(train.main(sys.argv[1:]))
"""

_DURING_FINAL_EVAL = """
evaluate = hooks.Evaluate.__call__
def wrapped(self, info):
    if info.step >= info.total_steps:
        press()
    return evaluate(self, info)
hooks.Evaluate.__call__ = wrapped
"""

_TWICE_AROUND_THE_SAVE = """
save = hooks.Save.__call__
def wrapped(self, info):
    save(self, info)
    if info.step == 2 or info.stopped_by:  # the first press; the second once step 3 is saved
        press()
hooks.Save.__call__ = wrapped
"""


def _press(work: Path, name: str, steps: int, patch: str) -> tuple[subprocess.CompletedProcess,
                                                                  Path]:
    model = work / name
    gin = _gin(work, name, model, steps, "CheckpointConfig.save_every = 100_000\n")
    return _cmd(work, ["-c", _PRESS.format(patch=patch), f"--gin_file={gin}"]), model


@slow
def test_ctrl_c_during_the_final_eval_stops_it_and_a_rerun_runs_it(work, finished):
    """A first Ctrl-C during the final eval ends it at once (the last step is saved), not
    after it; the rerun of the same command, with nothing to train, runs the eval it
    skipped and writes the summary and its table."""
    r, model = _press(work, "ctrl_c_final_eval", 3, _DURING_FINAL_EVAL)
    assert r.returncode == 130, (r.returncode, r.stderr[-3000:])
    assert _lines(r.stderr) == [], r.stderr[-3000:]
    assert _lines(r.stdout)[-1] == "stopped by Ctrl-C after step 3; checkpoint saved", r.stdout
    assert _ckpt_steps(model) == [3]
    assert not any("eval/loss" in row for row in _rows(model))  # stopped, not finished
    assert not (model / "summary.json").exists()
    r = _cmd(work, ["-m", "ode_lm", "train", f"--gin_file={work / 'ctrl_c_final_eval.gin'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "its final eval did not run (stopped by Ctrl-C?): running it now" in r.stdout
    assert any(line.startswith("one set of weights") for line in r.stdout.splitlines())
    assert json.loads((model / "summary.json").read_text())["steps"] == 3
    assert [row["step"] for row in _rows(model) if "eval/loss" in row] == [3]
    assert _ckpt_steps(model) == [3]
    before = tree_hash(model)  # and then: nothing to train, nothing changed
    r = _cmd(work, ["-m", "ode_lm", "train", f"--gin_file={work / 'ctrl_c_final_eval.gin'}"])
    assert r.returncode == 0 and "nothing to train" in r.stdout, r.stdout
    assert tree_hash(model) == before


@slow
def test_a_second_ctrl_c_names_the_latest_complete_checkpoint(work, finished):
    r, model = _press(work, "ctrl_c_after_save", 100, _TWICE_AROUND_THE_SAVE)
    assert r.returncode == 130, (r.returncode, r.stderr[-3000:])
    assert _ckpt_steps(model) == [3]  # the first press stopped after step 3, which saved
    assert _lines(r.stderr) == ["ode-lm-train: stopped by a second Ctrl-C at step 3; the "
                                "latest complete checkpoint is step 3"], r.stderr[-3000:]
    assert not (model / "run.lock").exists()


# ------------------------------------------------------- a save that cannot finish


@contextlib.contextmanager
def _immutable(path: Path):
    """``chattr +i``: not even root may write in ``path`` (chmod does not stop root)."""
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root on ext4-like filesystems)")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@slow
def test_a_save_that_cannot_be_written_fails_fast_in_one_line(work, finished):
    model = _copy(finished, work / "read_only")
    checkpoints = model / "checkpoints"
    before = tree_hash(checkpoints)
    gin = _gin(work, "read_only", model, 3)
    with _immutable(checkpoints):
        t0 = time.time()
        r = _cmd(work, ["-m", "ode_lm.commands.train", f"--gin_file={gin}",
                        "--gin.TRAIN_STEPS=5"])  # changed settings: a config.3.gin to keep
        took = time.time() - t0
        assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
        lines = _lines(r.stderr)
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert lines[0].startswith("ode-lm-train: error: saving checkpoint step 4"), lines
        assert f"cannot write to {checkpoints}" in lines[0], lines
        assert "latest complete checkpoint is still step 3" in lines[0], lines
        assert took < 120, f"{took:.0f}s: the failed save waited for orbax's timeout"
        assert tree_hash(checkpoints) == before  # the earlier checkpoints intact
    assert not (model / "config.3.gin").exists(), "a config for a checkpoint never saved"
    assert not (model / "run.lock").exists()


# --------------------------------------------------------- 6. damaged checkpoint


def _truncate_latest(model: Path) -> int:
    step = _ckpt_steps(model)[-1]
    # Every array data file of the step (which file holds the params depends on orbax's
    # write order, so one file is not enough); the small OCDBT tree nodes stay readable.
    data = (model / "checkpoints" / str(step) / "state").glob("ocdbt.process_*/d/*")
    victims = [p for p in data if p.stat().st_size > 4096]
    assert victims
    for victim in victims:
        victim.write_bytes(victim.read_bytes()[:8])
    return step


@slow
def test_damaged_latest_checkpoint_is_one_line_and_the_summary_names_the_step(work, finished):
    model = _copy(finished, work / "damaged")
    damaged = _truncate_latest(model)
    before = tree_hash(model)
    r = _cmd(work, ["-m", "ode_lm.commands.eval", f"--model_dir={model}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _lines(r.stderr) == [f"checkpoint step {damaged} is damaged (a file is truncated): "
                                f"falling back to step {damaged - 1}"], r.stderr
    assert f"step: {damaged - 1}.0000" in r.stdout
    r = _cmd(work, ["tools/convert_ckpt.py", f"--model_dir={model}", "--format=raw",
                    f"--out={work / 'damaged_export'}"])
    assert r.returncode == 0 and len(_lines(r.stderr)) == 1, r.stderr
    assert f"exported step {damaged - 1} of" in r.stdout
    assert tree_hash(model) == before


@slow
def test_eval_log_on_a_run_in_training_is_refused_before_it_evaluates(work, finished):
    """``eval --log`` takes the run lock first: while a run holds MODEL_DIR it is refused
    at once, in one line, having evaluated nothing and changed nothing."""
    before = tree_hash(finished)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from ode_lm.training import run_lock\n"
         f"with run_lock.hold({str(finished)!r}):\n    print('held', flush=True)\n"
         "    sys.stdin.read()\n"], cwd=REPO, env=_env(work), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = _cmd(work, ["-m", "ode_lm", "eval", f"--model_dir={finished}", "--log"])
    finally:
        holder.communicate("", timeout=60)
    err = r.stderr.strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1, (r.stdout, err[-2000:])
    assert "is in use by another training run" in err, err
    assert r.stdout == "", r.stdout  # nothing evaluated
    assert tree_hash(finished) == before


@slow
def test_eval_at_another_n_prints_its_gap_to_the_runs_own(work, finished):
    """``eval --num_steps=4`` on a run trained at N=2 evaluates the own N too and prints the
    gap, as ``--solves`` does; the run is left as it was."""
    before = tree_hash(finished)
    r = _cmd(work, ["-m", "ode_lm", "eval", f"--model_dir={finished}", "--num_steps=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.splitlines()[-1])
    gap = results["eval/perplexity@steps=4"] / results["eval/perplexity"] - 1
    assert results["eval/depth_gap/steps=4"] == pytest.approx(gap, abs=1e-9)
    assert any(line.startswith("steps=4: perplexity ") and f"gap {gap:+.2%}" in line
               for line in r.stdout.splitlines()), r.stdout
    assert tree_hash(finished) == before


@slow
@pytest.mark.parametrize("command", ["eval", "sample"])
def test_ctrl_c_outside_training_is_one_line_and_130(work, finished, command):
    """Ctrl-C in ``eval`` (mid-evaluation) and ``sample`` (compiling or decoding, inside
    long XLA calls), pressed as a terminal does (the whole process group): one stderr line,
    no traceback, no crash, exit 130, the run left as it was."""
    before = tree_hash(finished)
    argv = {"eval": ["--num_steps=64,128,256,512,1024,2048,4096"],
            "sample": ["--prompt=The", "--max_new_tokens=24", "--num_steps=4096",
                       "--solver=rk4"]}[command]
    proc = subprocess.Popen([shutil.which("ode-lm") or pytest.skip("no ode-lm script"),
                             command, f"--model_dir={finished}", *argv], cwd=REPO,
                            env=_env(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=terminal.foreground)
    time.sleep({"eval": 12, "sample": 7}[command])  # restored, evaluating or compiling
    assert proc.poll() is None, ("finished before the Ctrl-C: give it more work",
                                 proc.communicate())
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, (proc.returncode, out[-2000:], err[-3000:])
    assert _lines(err) == [f"ode-lm {command}: stopped by Ctrl-C"], err[-3000:]
    assert tree_hash(finished) == before


def _rot_latest(model: Path) -> int:
    """Bit rot: the latest step's array data files keep their size, their bytes random."""
    step = _ckpt_steps(model)[-1]
    data = (model / "checkpoints" / str(step) / "state").glob("ocdbt.process_*/d/*")
    victims = [p for p in data if p.stat().st_size > 4096]
    assert victims
    for victim in victims:
        victim.write_bytes(np.random.default_rng(0).bytes(victim.stat().st_size))
    return step


@slow
def test_bit_rotted_checkpoint_is_damaged_not_nan(work, finished):
    """Random bytes of the right size read back as NaN/Inf parameters: the step is damaged
    (named, one line), never a ``nan`` eval with exit 0 or a resume that blames the
    learning rate."""
    model = _copy(finished, work / "rotted")
    rotted = _rot_latest(model)
    before = tree_hash(model)
    for argv in (["eval", f"--model_dir={model}", f"--step={rotted}"],
                 ["sample", f"--model_dir={model}", f"--step={rotted}", "--prompt=The",
                  "--max_new_tokens=2", "--no_timing"]):
        r = _cmd(work, ["-m", "ode_lm", *argv])
        err = r.stderr.strip()
        assert r.returncode == 1, (argv[0], r.stdout[-2000:], err[-2000:])
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"ode-lm {argv[0]}: error: checkpoint "
                              f"{model / 'checkpoints' / str(rotted)} is damaged (NaN or Inf in "
                              ), err
    r = _cmd(work, ["-m", "ode_lm", "eval", f"--model_dir={model}"])  # the latest: falls back
    assert r.returncode == 0, r.stderr[-3000:]
    [line] = _lines(r.stderr)
    assert line.startswith(f"checkpoint step {rotted} is damaged (NaN or Inf in "), line
    assert line.endswith(f"falling back to step {rotted - 1}"), line
    assert f"step: {rotted - 1}.0000" in r.stdout and "nan" not in r.stdout, r.stdout
    assert tree_hash(model) == before
    r = _cmd(work, ["-m", "ode_lm.commands.train", f"--gin_file={work / 'finished.gin'}",
                    f"--gin.MODEL_DIR='{model}'", "--gin.TRAIN_STEPS=4"])  # resumes at 2
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoint step {rotted} is damaged (NaN or Inf in " in r.stderr, r.stderr
    assert "resumed from step 2" in r.stdout, r.stdout


def test_damage_cause_is_a_few_words():
    from ode_lm.training.checkpoint import damage_cause

    try:
        try:
            raise ValueError('OUT_OF_RANGE: Error reading "params.x/0.0" in OCDBT database: '
                             "Requested byte range [6, 9) is not valid for value of size 4")
        except ValueError as inner:
            raise Exception("Encountered error while reading array index: " + "x" * 400) \
                from inner
    except Exception as e:  # noqa: BLE001 - the shape TensorStore's errors come in
        assert damage_cause(e) == "a file is truncated"
    assert damage_cause(json.JSONDecodeError("Expecting value", "", 0)) == \
        "a file is empty or not JSON"


# ------------------------------------------------------------------ 5. export


@slow
def test_export_without_its_data_dir_is_refused_unless_weights_only(work, finished):
    model = _copy(finished, work / "no_data")
    cfg = json.loads((model / "data_config.json").read_text())
    cfg["data_dir"] = str(work / "gone")
    (model / "data_config.json").write_text(json.dumps(cfg))
    before, out = tree_hash(model), work / "hf_out"
    r = _cmd(work, ["tools/convert_ckpt.py", f"--model_dir={model}", "--format=hf",
                    f"--out={out}"])
    assert r.returncode == 1 and not out.exists()
    lines = _lines(r.stderr)
    assert len(lines) == 1 and str(work / "gone") in lines[0], r.stderr
    assert "--weights_only" in lines[0]
    r = _cmd(work, ["tools/convert_ckpt.py", f"--model_dir={model}", "--format=hf",
                    f"--out={out}", "--weights_only"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(out.glob("tokenizer*")) and not (out / "ode_lm_tokenizer.json").exists()
    for name in ("generation_config.json", "config.json"):
        text = (out / name).read_text()
        assert "null" not in text, (name, text)
    assert tree_hash(model) == before


def test_token_ids_never_null(tmp_path):
    from ode_lm.export.tokenizer_files import check_tokenizer_source, token_ids

    assert token_ids(None) == {} and token_ids(str(tmp_path)) == {}
    with pytest.raises(FileNotFoundError, match=f"data dir {tmp_path} is missing"):
        check_tokenizer_source(str(tmp_path))
    check_tokenizer_source(None)  # a run built in code records no data: weights alone


# ------------------------------------------------------- 4. adaptive step cap


@slow
def test_eval_cli_warns_in_one_line_when_the_step_cap_is_hit(work, finished):
    before = tree_hash(finished)
    r = _cmd(work, ["-m", "ode_lm.commands.eval", f"--model_dir={finished}", "--solver=adaptive",
                    "--rtol=1e-9", "--atol=1e-12"])
    assert r.returncode == 0, r.stderr[-3000:]
    # a slow host may also show the eval's progress line ("eval@...: 1/1 batches | ..."),
    # which is time-based; the warning itself is one line
    lines = [line for line in _lines(r.stderr) if not re.search(r": \d+/\d+ batches( \||$)", line)]
    assert len(lines) == 1 and "step cap (256) on 1 of 1 batches (100%)" in lines[0], r.stderr
    assert tree_hash(finished) == before


def test_adaptive_solve_reports_the_step_cap():
    from ode_lm.models.solvers import solve_adaptive

    x0 = jnp.ones((2, 3), jnp.float32)
    stiff = lambda x, t: -50.0 * x * jnp.cos(40.0 * t)  # noqa: E731
    _, free = solve_adaptive(stiff, x0, rtol=1e-3, atol=1e-6)
    _, capped = solve_adaptive(stiff, x0, rtol=1e-3, atol=1e-6, max_steps=3)
    assert not bool(free.capped) and bool(capped.capped)
    assert int(capped.accepted) + int(capped.rejected) == 3


def test_eval_loop_warns_once_with_the_capped_fraction(caplog):
    from ode_lm.training.step import run_eval

    outputs = iter([(2.0, 4.0, 30.0, 1.0), (2.0, 4.0, 10.0, 0.0), (2.0, 4.0, 10.0, 0.0),
                    (2.0, 4.0, 10.0, 1.0)])
    with caplog.at_level(logging.WARNING, logger="ode_lm"):
        res = run_eval(lambda p, b: next(outputs), None, range(4), label="eval@adaptive")
    assert res.capped == 0.5 and res.loss == 0.5 and res.nfe == 15.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "step cap (256) on 2 of 4 batches (50%)" in warnings[0]


def test_progress_line_has_an_eta_and_short_passes_stay_quiet():
    from ode_lm.training.metrics import Progress

    now, shown = [0.0], []
    p = Progress("eval", 40, clock=lambda: now[0], log_fn=shown.append, every_s=10)
    now[0] = 5.0
    p.update(4)
    assert shown == []
    now[0] = 10.0
    p.update(8)
    assert shown == ["eval: 8/40 batches | 0.8/s | ETA 40s"]
    quiet = Progress("eval", 3, clock=lambda: 0.0, log_fn=shown.append)
    quiet.update(3)
    quiet.done()
    assert len(shown) == 1


# --------------------------------------------------------- 1. one timeline


def test_trim_after_drops_rows_and_events_past_the_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ode_lm.training import metrics

    writer = metrics.create_writer(str(tmp_path), process_index=0)
    for step in range(1, 6):
        writer.write_scalars(step, {"train/loss": float(step)})
    writer.close()
    events = sorted(str(p) for p in tmp_path.glob("events.out.tfevents.*"))
    assert metrics.trim_after(str(tmp_path / "metrics.jsonl"), events, 3) == 2
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3]
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert metrics.trim_after(str(tmp_path / "metrics.jsonl"), events, 3) == 0


def test_config_changes_name_each_binding():
    from ode_lm.gin_setup import config_changes

    old = "ODE_STEPS = 4\nModelConfig.num_steps = %ODE_STEPS\nOptimizerConfig.lr = 0.001\n"
    new = "ODE_STEPS = 8\nModelConfig.num_steps = %ODE_STEPS\nOptimizerConfig.lr = 0.001\n"
    assert config_changes(old, new) == ["ODE_STEPS 4 \u2192 8"]
    assert config_changes(old, old) == []
    terms = "StepConfig.terms = [@RandomSteps(), @KineticEnergy()]\nA.x = 0.001\n"
    assert config_changes(terms, terms) == []  # by value, not by object address
    assert config_changes(terms, terms.replace("0.001", "1e-3").replace("[", "(")
                          .replace("]", ")")) == []
    assert config_changes(terms, terms.replace("@KineticEnergy()", "@Distillation()")) == [
        "StepConfig.terms (@RandomSteps(), @KineticEnergy()) \u2192 "
        "(@RandomSteps(), @Distillation())"]


def test_second_sigint_raises_stop_now():
    from ode_lm.training.preemption import PreemptionWatcher, StopNow

    # a background job's SIGINT starts as SIG_IGN, a terminal's as default_int_handler:
    # uninstall puts back whichever was there
    before = signal.getsignal(signal.SIGINT)
    w = PreemptionWatcher().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert w.should_stop(1) and w.reason == "Ctrl-C"
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    finally:
        w.uninstall()
    assert signal.getsignal(signal.SIGINT) is before



def test_a_first_ctrl_c_ends_the_final_eval_at_once():
    from ode_lm.training.preemption import PreemptionWatcher, StopEval

    before = signal.getsignal(signal.SIGINT)
    w = PreemptionWatcher().install()
    try:
        with pytest.raises(StopEval), w.interruptible():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler runs here: the eval does not go on
            raise AssertionError("the eval went on after Ctrl-C")
        assert w.reason == "Ctrl-C" and w.should_stop(3)
        with pytest.raises(StopEval), w.interruptible():  # pressed before: never begins
            raise AssertionError("an eval begun after Ctrl-C")
    finally:
        w.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_long_first_batch_is_not_silent():
    """``eval --num_steps=100000``: the first batch solves for minutes; the progress line
    says so every ``every_s`` instead of nothing, and stops with the pass."""
    from ode_lm.training.metrics import Progress

    shown = []
    p = Progress("eval@steps=100000", 4, every_s=0.1, log_fn=shown.append, heartbeat=True)
    time.sleep(0.5)
    p.update(1)
    p.done()
    count = len(shown)
    time.sleep(0.3)
    assert len(shown) == count  # the heartbeat ended with the pass
    assert shown[0].startswith("eval@steps=100000: 0/4 batches | 0s on the first "
                               "(compile + run)"), shown
    assert shown[-1].startswith("eval@steps=100000: 1/4 batches | "), shown
