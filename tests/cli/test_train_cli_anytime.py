"""Exact resume after SIGKILL and the TensorBoard scalars with every term of the objective
on (weighted random N, kinetic energy, self-distillation, a solver share and
distillation into a second solver, each of the last three on a drawn share of the steps,
the distillation's stratified over blocks of steps, so the host picks a compiled variant
per step): the subprocess harness of train_cli_helpers with these bindings added."""

from __future__ import annotations

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
Distillation.block_steps = 4
SolverShare.share = 0.5
SolverShare.solver = 'midpoint'
SolverShare.num_steps = 1
SolverDistillation.share = 0.5
SolverDistillation.solver = 'rk4'
SolverDistillation.num_steps = 1
StepConfig.terms = [@RandomSteps(), @KineticEnergy(), @Distillation(), @SolverShare(),
                    @SolverDistillation()]
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_cli_anytime")


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    return cli.reference_run(workdir, ANYTIME_GIN)[0]


def test_anytime_terms_and_draws_reach_tensorboard(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(reference))
    acc.Reload()
    values = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    from ode_lm.training.objective import Distillation, SolverDistillation, SolverShare

    seed = 0  # TrainConfig.seed of the micro run
    distill = Distillation(share=0.5, block_steps=4)
    distilled = [s for s in range(2 * cli.K) if distill.choose(seed, s)]
    shared = [float(SolverShare(share=0.5).choose(seed, s)) for s in range(2 * cli.K)]
    pulled = [s for s in range(2 * cli.K) if SolverDistillation(share=0.5).choose(seed, s)]
    # log_every = 1: a row per step; a term's metrics on the steps its host draw picked
    steps = [e.step for e in acc.Scalars("train/distill_loss")]
    assert steps == [s + 1 for s in distilled] and distilled, steps
    assert all(v > 0 for v in values["train/distill_loss"])
    assert set(values["train/distill_num_steps"]) == {1.0}
    assert values["train/solver_share"] == shared and 0 < sum(shared) < len(shared)
    steps = [e.step for e in acc.Scalars("train/solver_distill_loss")]
    assert steps == [s + 1 for s in pulled] and 0 < len(pulled) < 2 * cli.K, steps
    assert all(v > 0 for v in values["train/solver_distill_loss"])
    assert set(values["train/num_steps"]) <= {1.0, 2.0, 3.0}
    assert len(values["train/kinetic_energy"]) == 2 * cli.K  # every step: its term is on
    assert min(values["train/kinetic_energy"]) > 0
    assert all(v > 0 for v in values["train/flops_per_token"])


def test_exact_resume_after_sigkill_with_the_anytime_recipe(workdir, reference):
    cli.kill_and_resume(workdir, reference, ANYTIME_GIN)
