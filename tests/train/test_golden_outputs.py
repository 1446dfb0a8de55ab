"""Saved outputs of a tiny deterministic setup, compared against committed values: the train
losses of the default recipe (and of the terms that run a second solve), and eval losses at
several solves, for recipes whose maths does not change. A refactor of how a solve is spelled
(its settings, the forward's arguments, the eval settings) must leave them identical.

Bitwise on the host and jax version that wrote them (``host`` in the file): the same float32
program gives the same bits. Elsewhere the CPU's instruction set and XLA's fusion choices may
reassociate float32 sums, a few ulps per operation (tests/numerics.py), and training
compounds them over the steps, so another host compares at ``CROSS_HOST_RTOL``: 2**10 ulps,
far below any change of the maths (a changed recipe moves the losses by 1e-3 or more).

``ODE_LM_WRITE_GOLDEN=1 python -m pytest tests/train/test_golden_outputs.py`` rewrites the
file; only do so for a change that is meant to change the maths, and say so in its commit.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import jax
import model_helpers
import numpy as np
import optax
import pytest
from numerics import F32_EPS

from ode_lm import partitioning
from ode_lm.models import build_model
from ode_lm.models.solve import Solve
from ode_lm.training import objective as obj
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib

GOLDEN = Path(__file__).parents[1] / "testdata" / "golden" / "solve_outputs.json"
CROSS_HOST_RTOL = 1024 * F32_EPS  # ≈ 1.2e-4

ODE = dict(model_helpers.LIVELY, max_seq_len=16, time_scale=4.0, time_max_period=100.0,
           random_grid_offset=True)
# recipes/default.gin at the micro scale: random N, kinetic energy, distillation on a share
# of the steps and a ramped share solved by rk4, shares drawn over blocks of 4 steps
DEFAULT = (obj.RandomSteps(choices=(2, 3, 4)), obj.KineticEnergy(weight=2.0),
           obj.Distillation(weight=0.5, num_steps=(1, 2), share=0.25, block_steps=4),
           obj.SolverShare(share=0.25, final=0.5, ramp_steps=8, solver="rk4", num_steps=2,
                           block_steps=4))
# the term that solves the batch a second time, on a share of the steps and rows
SECOND_SOLVES = (obj.SolverDistillation(share=0.5, num_steps=1, row_stride=2),)
# (solver, N or rtol): the eval settings after training
EVALS = (("euler", 2), ("euler", 4), ("rk4", 2), ("midpoint", 3), ("adaptive", 1e-3),
         ("dopri5", 1e-2))


def _spec(cfg):
    mesh = partitioning.create_mesh((1, 1, 1), devices=jax.devices()[:1])
    return state_lib.build_state_spec(lambda rngs: build_model(cfg, rngs),
                                      optax.adam(3e-3), mesh, partitioning.axis_rules())


def _batch(seed: int):
    x = np.random.default_rng(seed).integers(0, 64, (4, 17)).astype(np.int32)
    return {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": np.ones((4, 16), np.int32),
            "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
            "loss_mask": np.ones((4, 16), np.float32)}


def _train(spec, terms, steps: int, seed: int = 0):
    """(per-step loss, the steps' draws, final params)."""
    fn = step_lib.jit_train_step(spec, optax.constant_schedule(3e-3),
                                 step_lib.StepConfig(terms=terms), seed)
    state, losses, variants = state_lib.init_state(spec, seed), [], []
    with jax.set_mesh(spec.mesh):
        for i in range(steps):
            state, m = fn(state, _batch(i), i)
            losses.append(float(m["loss"]))
            variants.append([bool(v) if v is not None else None for v in fn.variant(i)])
    return losses, variants, state["params"]


def _evaluate(spec, params, solver, setting):
    """Loss and NFE over two batches at one solve (N for a fixed grid, else rtol)."""
    if solver in ("adaptive", "bosh3", "dopri5"):
        step = step_lib.make_eval_step(spec, Solve(solver, rtol=setting))
    else:
        step = step_lib.make_eval_step(spec, Solve(solver, setting))
    with jax.set_mesh(spec.mesh):
        res = step_lib.run_eval(step, params, [_batch(100), _batch(101)])
    return {"loss": res.loss, "nfe": res.nfe, "capped": res.capped}


def _host() -> dict:
    return {"machine": platform.machine(), "processor": _cpu_model(),
            "jax": jax.__version__, "jaxlib": jax.lib.__version__}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _outputs() -> dict:
    spec = _spec(model_helpers.tiny_config(ODE))
    losses, variants, params = _train(spec, DEFAULT, 16)
    second, second_variants, _ = _train(spec, SECOND_SOLVES, 6)
    evals = {f"{s}:{v:g}": _evaluate(spec, params, s, v) for s, v in EVALS}
    base_spec = _spec(model_helpers.tiny_config(ODE, architecture="parallel", num_layers=2))
    base_losses, _, base_params = _train(base_spec, (), 3)
    return {"default": {"losses": losses, "variants": variants},
            "second_solves": {"losses": second, "variants": second_variants},
            "eval": evals,
            "parallel": {"losses": base_losses,
                         "eval": _evaluate(base_spec, base_params, None, None)}}


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, tree


@pytest.mark.slow
def test_saved_outputs_of_unchanged_recipes_stay_identical():
    got = _outputs()
    if os.environ.get("ODE_LM_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"host": _host(), "outputs": got}, indent=1) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    saved = json.loads(GOLDEN.read_text())
    want = dict(_flat(saved["outputs"]))
    have = dict(_flat(json.loads(json.dumps(got))))  # as the file holds them
    assert have.keys() == want.keys()
    # the draws are host-side integers and booleans: equal everywhere
    assert {k: v for k, v in have.items() if not isinstance(v, float)} == \
        {k: v for k, v in want.items() if not isinstance(v, float)}
    if saved["host"] == _host():
        changed = {k: (want[k], have[k]) for k in want if have[k] != want[k]}
        assert not changed, f"not bitwise identical on the host that wrote them: {changed}"
    else:
        for k, v in want.items():
            if isinstance(v, float):
                assert have[k] == pytest.approx(v, rel=CROSS_HOST_RTOL), k
