"""Exact resume after SIGKILL and the TensorBoard scalars with the anytime recipe on
(weighted random N, self-distillation across grids): the subprocess
harness of train_cli_helpers with these StepConfig bindings added."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    return cli.reference_run(workdir, ANYTIME_GIN)[0]


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
    cli.kill_and_resume(workdir, reference, ANYTIME_GIN)
