"""A saved run's model: the one way to load a run's parameters (``load_model``) and the one
loaded-run class (``LoadedRun``) that analysis, eval, export, sampling and fine-tuning use.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

from ode_lm import partitioning
from ode_lm.data.config import DataConfig
from ode_lm.models.config import ModelConfig
from ode_lm.training import checkpoint as ckpt_lib
from ode_lm.training.run_dir import DATA_CONFIG, RunDir


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A saved run's parameters on a mesh: ``spec`` is the plain model's (LoRA already
    merged), so ``step.make_eval_step(spec, ...)`` and ``spec.model(params)`` apply.
    ``data_config`` is the run's own (None when it records none)."""

    model_dir: str
    config: ModelConfig
    step: int
    spec: Any  # training.state.StateSpec
    params: Any
    finetune: dict[str, Any] | None
    data_config: DataConfig | None
    mesh: Any
    rules: Any

    def model(self):
        return self.spec.model(self.params)

    def evaluator(self, split: str = "validation"):
        """``training.evaluation.Evaluator`` over the whole split (what the trainer uses)."""
        from ode_lm.data import (
            check_eval_split,
            load_manifest,
            make_eval_iterator,
            to_global_batch,
        )
        from ode_lm.training.evaluation import Evaluator

        data = self.data_config
        if data is None:
            raise FileNotFoundError(f"--model_dir={self.model_dir}: no data config naming the "
                                    "run's data: is it a training run?")

        def batches():
            return (to_global_batch(b, self.mesh, self.rules)
                    for b in make_eval_iterator(data, split))

        return Evaluator(self.spec, batches, model_num_steps=self.config.num_steps,
                         model_solver=self.config.solver, model_rtol=self.config.rtol,
                         what=f"split {split!r} of {data.data_dir}",
                         num_batches=check_eval_split(data, load_manifest(data.data_dir), split))

    def evaluate(self, num_steps: int | None = None, solver: str | None = None, *,
                 rtol: float | None = None, atol: float | None = None,
                 split: str = "validation"):
        """``step.EvalResult`` (loss, tokens, mean NFE) over the whole split."""
        return self.evaluator(split).result(self.params, num_steps, solver, rtol=rtol, atol=atol)


def load_model(model_dir: str, step: int | None = None, *, mesh=None, rules=None,
               read_run: Callable[[str], RunDir] = RunDir):
    """``(model, LoadedRun)``: a saved run's model with its parameters (latest complete
    checkpoint, or ``step``), LoRA fine-tunes with their update merged into the weights.

    Parameters only (never the optimizer state), from a checkpoint saved on any mesh, onto
    ``mesh`` (default: one CPU device) under ``rules`` (default: the standard table).
    ``read_run``: how the run directory is read (``gin_setup.run_dir`` also reads the data
    settings of runs from before ``data_config.json``).
    """
    import jax
    import optax

    from ode_lm.models import build_model
    from ode_lm.training import state as state_lib

    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"--model_dir={model_dir}: no such directory")
    run = read_run(model_dir)
    config = run.model_config()
    finetune = run.finetune()
    if mesh is None:
        mesh = partitioning.create_mesh((1, 1, 1), devices=[jax.local_devices(backend="cpu")[0]])
    rules = rules if rules is not None else partitioning.axis_rules()
    model_fn = functools.partial(build_model, config)
    spec = state_lib.build_state_spec(model_fn, optax.identity(), mesh, rules)
    if finetune is None or finetune.get("method") != "lora":
        params, step = ckpt_lib.restore_params(model_dir, spec.abstract_params, step)
    else:  # the checkpoint holds the wrapped model: restore it wrapped, then merge
        from flax import nnx

        from ode_lm.lora import lora_model_fn, lora_spec_from_dict, merge_lora

        wrapped = state_lib.build_state_spec(
            lora_model_fn(config, lora_spec_from_dict(finetune["lora"])), optax.identity(),
            mesh, rules)
        lora_params, step = ckpt_lib.restore_params(model_dir, wrapped.abstract_params, step)
        merged = merge_lora(wrapped.model(lora_params))
        params = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding),
                              nnx.to_pure_dict(nnx.state(merged, nnx.Param)),
                              spec.abstract_params)
    loaded = LoadedRun(model_dir, config, step, spec, params, finetune, run.data_config(),
                       mesh, rules)
    return loaded.model(), loaded


def load_run(model_dir: str, step: int | None = None, *,
             read_run: Callable[[str], RunDir] = RunDir) -> LoadedRun:
    """A run to evaluate: its parameters on all local devices (batch-sharded), and its data
    config, which must exist."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"--model_dir={model_dir}: no such directory")
    if read_run(model_dir).data_config() is None:
        raise FileNotFoundError(f"--model_dir={model_dir}: no {DATA_CONFIG} naming the "
                                "run's data: is it a training run?")
    mesh = partitioning.create_mesh((1, -1, 1))
    _, run = load_model(model_dir, step, mesh=mesh, rules=partitioning.axis_rules(),
                        read_run=read_run)
    return run
