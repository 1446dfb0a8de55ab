"""A solver is one ``TABLEAUS`` entry: the solver lists everywhere (settings, CLIs, the solve
parser, the docs) are that table, and a tableau added in test code trains and evaluates."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import model_helpers
import numpy as np
import optax
import pytest

from ode_lm import partitioning
from ode_lm.models import build_model
from ode_lm.models.config import ADAPTIVE_SOLVERS, SOLVERS, ModelConfig
from ode_lm.models.solve import Solve
from ode_lm.models.tableaus import ALIASES, TABLEAUS, Tableau
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib

REPO = Path(__file__).resolve().parents[2]
# Ralston's second-order method: in no table of ode-lm
RALSTON = Tableau(c=(0.0, 2 / 3), a=((), (2 / 3,)), b=(1 / 4, 3 / 4), order=2)


def test_the_solver_lists_are_the_tableaus():
    assert set(SOLVERS) == {n for n, t in TABLEAUS.items() if t.b_low is None}
    assert set(ADAPTIVE_SOLVERS) == {n for n, t in TABLEAUS.items() if t.b_low is not None} \
        | set(ALIASES)
    assert all(target in ADAPTIVE_SOLVERS for target in ALIASES.values())
    assert not set(SOLVERS) & set(ADAPTIVE_SOLVERS)


def _listed(text: str) -> list[list[str]]:
    """Runs of three or more known solver names joined by ', ' or '|' in a page."""
    names = "|".join(sorted(TABLEAUS.keys() | ALIASES.keys(), key=len, reverse=True))
    run = re.compile(rf"\b(?:{names})(?:(?:, |\|)(?:{names})\b){{2,}}")
    return [re.split(r", |\|", m.group(0)) for m in run.finditer(text)]


def test_every_solver_list_in_the_docs_is_the_table():
    """A page that lists solvers lists all of a kind: the fixed-grid ones, the adaptive ones,
    or all of them."""
    fixed, adaptive = set(SOLVERS), set(ADAPTIVE_SOLVERS)
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = 0
    for page in pages:
        for names in _listed(page.read_text()):
            found += 1
            assert set(names) in (fixed, adaptive, fixed | adaptive), (page.name, names)
    assert found >= 2


@pytest.fixture
def ralston(monkeypatch):
    monkeypatch.setitem(TABLEAUS, "ralston", RALSTON)
    monkeypatch.setitem(TABLEAUS, "rk4_again", TABLEAUS["rk4"])


def test_a_tableau_added_in_test_code_is_a_solver_everywhere(ralston):
    assert "ralston" in SOLVERS and "ralston" not in ADAPTIVE_SOLVERS
    assert str(Solve.parse("ralston:3")) == "ralston:steps=3"
    ModelConfig(solver="ralston")  # the setting's check accepts it
    model = model_helpers.tiny_model(model_helpers.LIVELY, vocab_size=61, num_steps=3)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 8)), jnp.int32)
    again = model(x, solve=Solve("rk4_again", 3))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(model(x, solve=Solve("rk4", 3))))
    assert not np.allclose(model(x, solve=Solve("ralston", 3)), again)


def test_a_tableau_added_in_test_code_trains(ralston):
    cfg = model_helpers.tiny_config(model_helpers.LIVELY, vocab_size=64, max_seq_len=16,
                                    solver="ralston", num_steps=2)
    mesh = partitioning.create_mesh((1, 1, 1), devices=jax.devices()[:1])
    spec = state_lib.build_state_spec(lambda rngs: build_model(cfg, rngs),
                                      optax.adam(1e-2), mesh, partitioning.axis_rules())
    fn = step_lib.jit_train_step(spec, optax.constant_schedule(1e-2), step_lib.StepConfig(), 0)
    x = np.random.default_rng(0).integers(0, 64, (4, 17)).astype(np.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:],
             "segment_ids": np.ones((4, 16), np.int32),
             "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
             "loss_mask": np.ones((4, 16), np.float32)}
    state, losses = state_lib.init_state(spec, 0), []
    with jax.set_mesh(spec.mesh):
        for i in range(4):
            state, metrics = fn(state, batch, i)
            losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
