"""Exact resume after SIGKILL and the TensorBoard scalars with the anytime recipe on
(weighted random N, self-distillation across grids): the subprocess
harness of train_cli_helpers with these StepConfig bindings added."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import train_cli_helpers as cli

pytestmark = pytest.mark.slow

ANYTIME_GIN = """
StepConfig.num_steps_choices = (1, 2, 3)
StepConfig.num_steps_weights = (2.0, 1.0, 1.0)
StepConfig.distill_weight = 0.5
StepConfig.distill_num_steps_choices = (1,)
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_cli_anytime")


def write_gin(workdir: Path, name: str, model_dir: Path) -> Path:
    path = cli.write_gin(workdir, name, model_dir)
    path.write_text(path.read_text() + ANYTIME_GIN)  # later gin bindings win
    return path


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    model_dir = workdir / "reference"
    rc, out, err = cli.run(workdir, write_gin(workdir, "reference", model_dir))
    assert rc == 0, err[-3000:]
    return model_dir


def test_anytime_terms_and_draws_reach_tensorboard(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(reference))
    acc.Reload()
    values = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert len(values["train/distill_loss"]) == 2 * cli.K  # log_every = 1: every step
    assert all(v > 0 for v in values["train/distill_loss"])
    assert set(values["train/distill_num_steps"]) == {1.0}
    assert "train/solver_share" not in values  # off: not logged
    assert set(values["train/num_steps"]) <= {1.0, 2.0, 3.0}


def test_exact_resume_after_sigkill_with_the_anytime_recipe(workdir, reference):
    model_dir = workdir / "killed"
    gin_file = write_gin(workdir, "killed", model_dir)
    rng = random.Random()
    kill_after = rng.randint(1, cli.K)
    proc = cli.start(workdir, gin_file)
    deadline = time.time() + 600
    while max(cli.checkpoint_steps(model_dir), default=0) < kill_after and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.1))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = cli.checkpoint_steps(model_dir)
    assert killed_at and killed_at[-1] < 2 * cli.K, (killed_at, proc.stderr.read()[-3000:])
    rc, out, err = cli.run(workdir, gin_file)
    assert rc == 0, err[-3000:]
    assert "resumed from step" in out
    assert cli.losses(model_dir) == cli.losses(reference)
    cli.assert_same_params(reference, model_dir)
