"""Exact resume after SIGKILL and the TensorBoard scalars with every term of the objective
on (weighted random N, kinetic energy, self-distillation and a solver share, each of the
last two on a drawn share of the steps, so the host picks a compiled variant per step): the
subprocess harness of train_cli_helpers with these bindings added."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import train_cli_helpers as cli

pytestmark = pytest.mark.slow

ANYTIME_GIN = """
RandomSteps.choices = (1, 2, 3)
RandomSteps.weights = (2.0, 1.0, 1.0)
Distillation.weight = 0.5
Distillation.num_steps = (1,)
Distillation.share = 0.5
SolverShare.share = 0.5
SolverShare.solver = 'midpoint'
SolverShare.num_steps = 1
StepConfig.terms = [@RandomSteps(), @KineticEnergy(), @Distillation(), @SolverShare()]
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
    from ode_lm.training.objective import Distillation, SolverShare

    seed = 0  # TrainConfig.seed of the micro run
    distilled = [s for s in range(2 * cli.K) if Distillation(share=0.5).choose(seed, s)]
    shared = [float(SolverShare(share=0.5).choose(seed, s)) for s in range(2 * cli.K)]
    # log_every = 1: a row per step; a term's metrics on the steps its host draw picked
    steps = [e.step for e in acc.Scalars("train/distill_loss")]
    assert steps == [s + 1 for s in distilled] and distilled, steps
    assert all(v > 0 for v in values["train/distill_loss"])
    assert set(values["train/distill_num_steps"]) == {1.0}
    assert values["train/solver_share"] == shared and 0 < sum(shared) < len(shared)
    assert set(values["train/num_steps"]) <= {1.0, 2.0, 3.0}
    assert all(v > 0 for v in values["train/flops_per_token"])


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
