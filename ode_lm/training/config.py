"""The trainer's own settings, each field checked when it is built: ``TrainConfig`` (the
loop, its evals) and ``MeshConfig`` (the mesh). The checks that need the devices, the model
and the data together, or the disk, run when the trainer is built: ``validate`` and
``ensure_writable``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ode_lm import partitioning
from ode_lm.config_types import (
    check_types,
    require,
    require_at_least,
    require_positive,
)
from ode_lm.errors import SettingError
from ode_lm.models.config import ModelConfig
from ode_lm.models.solve import Solve

# fields a TrainConfig no longer has: both are eval_solves now (a binding stops with one line)
REMOVED = {"eval_num_steps": "TrainConfig.eval_solves = ('steps=4', 'steps=12')",
           "eval_solver": "TrainConfig.eval_solves = ('rk4:steps=12', 'adaptive:rtol=1e-3')"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings (gin: ``TrainConfig.*``)."""

    model_dir: str
    num_train_steps: int
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only after the last step
    # the solves of every eval beside the model's own, in the words their names write after
    # '@' (models.solve.Solve: 'steps=8' the model's solver at 8 steps, 'rk4:steps=8',
    # 'adaptive:rtol=1e-3'): a depth sweep is ('steps=2', 'steps=4', ...)
    eval_solves: tuple[str, ...] = ()
    max_bad_steps: int = 10  # abort after this many consecutive NaN/Inf steps
    # None: the CPU's peak, the best probe cached per machine (hardware.cpu_peak_flops)
    cpu_peak_flops: float | None = None
    # lm-eval tasks (names or YAML files) run at each eval: lm_eval/<task>/<metric>, by the
    # hook the gin layer hands the trainer (harness.run.LmEval)
    lm_eval_tasks: tuple[str, ...] = ()
    lm_eval_include_path: str | None = None  # a directory of local task YAMLs
    lm_eval_limit: int | None = None  # documents per task (None: all)
    # jax's persistent compilation cache, so a rerun or resume compiles nothing: 'auto' is
    # $JAX_COMPILATION_CACHE_DIR when set, else gs://<bucket>/ode_lm/xla_cache for a run on
    # a bucket (shared by a pod's hosts) or ~/.cache/ode_lm/xla; '' turns it off
    compilation_cache_dir: str = "auto"
    # removed (REMOVED): refused with a line naming eval_solves
    eval_num_steps: Any = None
    eval_solver: Any = None

    @property
    def solves(self) -> tuple[Solve, ...]:
        """``eval_solves`` read (``Solve.parse``), in order."""
        return tuple(Solve.parse(s, "TrainConfig.eval_solves") for s in self.eval_solves)

    def __post_init__(self):
        for field, instead in REMOVED.items():
            if getattr(self, field) is not None:
                raise SettingError(f"TrainConfig.{field}={getattr(self, field)!r}: no longer a "
                                   f"setting; every eval solve is in TrainConfig.eval_solves "
                                   f"(e.g. {instead})")
        check_types(self)
        require(self, "model_dir", bool(self.model_dir.strip()), "must not be empty")
        require_at_least(self, 1, "num_train_steps", "log_every", "max_bad_steps",
                         "lm_eval_limit")
        require_at_least(self, 0, "seed", "eval_every")
        for spec in self.eval_solves:
            try:
                Solve.parse(spec, "TrainConfig.eval_solves")
            except ValueError as e:  # names the entry: TrainConfig.eval_solves='rk4:step=8'
                raise SettingError(str(e)) from None
        require_positive(self, "cpu_peak_flops")
        cache = self.compilation_cache_dir
        require(self, "compilation_cache_dir",
                cache in ("auto", "") or "://" in cache or not os.path.isfile(cache),
                "is a file, not a directory")
        require(self, "lm_eval_tasks", all(t.strip() for t in self.lm_eval_tasks),
                "a task name is empty")
        path = self.lm_eval_include_path
        require(self, "lm_eval_include_path", path is None or os.path.isdir(path),
                "no such directory")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape (gin: ``MeshConfig.*``); one -1 per tuple is filled in."""

    ici_parallelism: tuple[int, int, int] = (1, -1, 1)
    dcn_parallelism: tuple[int, int, int] = (1, 1, 1)
    rule_overrides: tuple = ()  # ((logical axis, mesh axes), ...) replacing table entries

    def __post_init__(self):
        check_types(self)
        for name in ("ici_parallelism", "dcn_parallelism"):
            dims = getattr(self, name)
            require(self, name, dims.count(-1) <= 1 and all(d >= 1 or d == -1 for d in dims),
                    "entries must be >= 1, with at most one -1")
        try:
            partitioning.axis_rules(self.rule_overrides)
        except (ValueError, TypeError) as e:
            require(self, "rule_overrides", False, str(e).removeprefix("axis_rules.overrides: "))


def validate(model: ModelConfig, data: Any, step_cfg: Any, mesh, rules) -> None:
    """Configuration errors that would otherwise surface deep inside compilation; the batch
    split is the run's (``rules`` with its MeshConfig.rule_overrides), not the default one.
    Settings of two configs that do not fit together: ``SettingError``, exit 2 like a
    refusal of one class's field."""
    shards = partitioning.batch_shards(mesh, rules)
    axes = partitioning.logical_to_mesh(("activation_batch",), rules)[0]
    batch = data.global_batch_size
    if batch % shards:
        raise SettingError(
            f"DataConfig.global_batch_size={batch} is not divisible by the {shards} batch "
            f"shards (activation_batch -> {axes} on mesh {dict(mesh.shape)})"
        )
    if batch % (shards * step_cfg.microbatches):
        raise SettingError(
            f"DataConfig.global_batch_size={batch} is not divisible by batch shards x "
            f"StepConfig.microbatches = {shards * step_cfg.microbatches}"
        )
    if data.seq_len > model.max_seq_len:
        raise SettingError(
            f"DataConfig.seq_len={data.seq_len} exceeds the model's positions "
            f"ModelConfig.max_seq_len={model.max_seq_len}"
        )


def ensure_writable(model_dir: str) -> None:
    """Fail early when MODEL_DIR cannot be written, without writing anything (the run lock,
    taken first thing in ``Trainer.run``, makes the directory). Object stores: not checked."""
    if "://" in model_dir:
        return
    path = os.path.abspath(model_dir)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        reason = "Not a directory" if not os.path.isdir(path) else "Permission denied"
        raise PermissionError(f"MODEL_DIR={model_dir!r} is not writable: {reason} ({path})")
