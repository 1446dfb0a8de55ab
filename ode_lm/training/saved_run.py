"""A saved run's model: the one way to load a run's parameters (``load_model``, through
``restore_params``: the parameters only, from a checkpoint saved on any mesh) and the one
loaded-run class (``LoadedRun``) that analysis, eval, export, sampling and fine-tuning use.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from ode_lm import partitioning
from ode_lm.data.config import DataConfig
from ode_lm.models.config import ModelConfig
from ode_lm.models.solve import OWN, Solve
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
        from ode_lm.training.inputs import check_tokenizer_record

        data = self.data_config
        if data is None:
            raise FileNotFoundError(f"--model_dir={self.model_dir}: no data config naming the "
                                    "run's data: is it a training run?")

        def batches():
            return (to_global_batch(b, self.mesh, self.rules)
                    for b in make_eval_iterator(data, split))

        manifest = load_manifest(data.data_dir)
        recorded = (RunDir(self.model_dir).inputs() or {}).get("tokenizer")
        check_tokenizer_record(recorded, manifest, f"--model_dir={self.model_dir}", None,
                               f"its data dir {data.data_dir}", "the data dir was prepared "
                               "again with another tokenizer; prepare it from the run's source")
        return Evaluator(self.spec, batches, model_num_steps=self.config.num_steps,
                         model_solver=self.config.solver, model_rtol=self.config.rtol,
                         what=f"split {split!r} of {data.data_dir}",
                         num_batches=check_eval_split(data, manifest, split))

    def evaluate(self, solve: Solve = OWN, *, split: str = "validation"):
        """``step.EvalResult`` (loss, tokens, mean NFE) over the whole split at ``solve``."""
        return self.evaluator(split).result(self.params, solve)


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
        params, step = restore_params(model_dir, spec.abstract_params, step)
    else:  # the checkpoint holds the wrapped model: restore it wrapped, then merge
        from flax import nnx

        from ode_lm.lora import lora_model_fn, lora_spec_from_dict, merge_lora

        wrapped = state_lib.build_state_spec(
            lora_model_fn(config, lora_spec_from_dict(finetune["lora"])), optax.identity(),
            mesh, rules)
        lora_params, step = restore_params(model_dir, wrapped.abstract_params, step)
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


def restore_params(model_dir: str, abstract_params: Any, step: int | None = None) -> tuple:
    """(params, step): only the parameters of a run, onto ``abstract_params``' shardings.

    Works from a checkpoint saved on any mesh; the optimizer state is never read. Without
    ``step``, a damaged latest step falls back to the previous complete one (warning);
    a damaged requested ``step`` raises CheckpointDamagedError.
    """
    ckpt_lib.install_save_noise_filters()  # a damaged step's failed reads report like a failed save
    local = "://" not in model_dir  # orbax wants absolute paths: a relative one read as damaged
    directory = epath.Path(RunDir(os.path.abspath(model_dir) if local else model_dir).checkpoints)
    steps = ckpt_lib.complete_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint under {directory}")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"checkpoint step {step} not in {directory} (have {steps})")
    candidates = [step] if step is not None else steps[::-1]
    for i, s in enumerate(candidates):
        try:
            params = _restore_params_at(directory / str(s) / "state", abstract_params)
            ckpt_lib.check_finite(params)  # bit rot reads back as NaN, not as an error
            return params, s
        except ckpt_lib.ShapeMismatchError:
            raise
        except Exception as e:
            ckpt_lib.report_damaged(directory, s, e, candidates[i + 1:])
    raise AssertionError("unreachable")


def _restore_params_at(path: epath.Path, abstract_params: Any) -> Any:
    """The ``params`` subtree of one ``state`` item. Read through the item handler, not a
    ``PyTreeCheckpointer``: the checkpointer looks for the step metadata
    (``_CHECKPOINT_METADATA``) inside the item directory, where it never is (the manager
    writes it one level up), and warns "Metadata file does not exist" on every restore."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        meta = handler.metadata(path)
        tree = meta.tree if hasattr(meta, "tree") else meta
        saved = ckpt_lib.flat_shapes(tree["params"])
        for name, shape in ckpt_lib.flat_shapes(abstract_params).items():
            if saved.get(name) != tuple(shape):
                raise ckpt_lib.ShapeMismatchError(
                    f"{path}: parameter {name!r} has shape {saved.get(name)} but the model "
                    f"wants {tuple(shape)}"
                )
        restored = handler.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item={"params": abstract_params},
                restore_args={"params": ckpt_lib.restore_args(abstract_params)},
                partial_restore=True,
            ),
        )
    finally:
        handler.close()
    return restored["params"]
