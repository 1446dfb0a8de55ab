"""Adaptive-depth fine-tuning (``ode-lm finetune --gin_file=configs/finetune/X.gin``).

A DiffEqFormer pretrained with N steps is fine-tuned as an M-step model (the paper: N = 18,
M ∈ {24, 18, 12, 9}), fully or with LoRA, in one of two modes:

* ``continuous``: keep the hypernetwork and train the ODE solved with M steps; LoRA goes on
  the hypernetworks' base weights W₀ (shared by every depth t);
* ``materialised``: ``materialize(model, M)`` → an M-layer parallel-block transformer with
  static weights, trained as such; LoRA goes on its stacked linear layers.

Everything else is the trainer's (data, checkpoints, metrics, resume): this module only
supplies ``model_fn`` (the LoRA wrapper), ``init_params_fn`` (the pretrained run, materialised
and wrapped), ``trainable`` (LoRA factors, plus embeddings if asked) and the record of what
the fine-tune was made from (``run_dir.FinetuneRecord``), which the trainer writes with its
run files, under its run lock, so exports rebuild and merge the same model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from ode_lm.config_types import (
    check_types,
    require,
    require_at_least,
    require_one_of,
    require_positive,
)
from ode_lm.errors import SettingError
from ode_lm.lora import LoRAModel, LoRASpec, lora_model_fn, lora_trainable
from ode_lm.models.accounting import param_count
from ode_lm.models.config import ModelConfig
from ode_lm.training.checkpoint import CheckpointConfig
from ode_lm.training.config import MeshConfig, TrainConfig
from ode_lm.training.evaluation import EvalHook
from ode_lm.training.inputs import prepare_data_once
from ode_lm.training.optim import OptimizerConfig
from ode_lm.training.run_dir import ConfigRecord, FinetuneRecord, RunDir
from ode_lm.training.state import default_model_fn
from ode_lm.training.step import StepConfig
from ode_lm.training.trainer import Trainer, TrainResult

METHODS = ("full", "lora")
MODES = ("continuous", "materialised")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """gin: ``FinetuneConfig.*`` (macros PRETRAINED_DIR, FINETUNE_STEPS, METHOD in configs)."""

    pretrained_dir: str
    num_steps: int  # M: solver steps (continuous) or layers (materialised)
    method: str = "full"
    mode: str = "continuous"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("qkv", "out", "mlp_*")
    train_embeddings: bool = False  # LoRA: also train token/position embeddings and the head
    pretrained_step: int | None = None  # None = latest

    def __post_init__(self):
        check_types(self)
        if self.num_steps <= 0:  # the configs' macro names it
            raise SettingError(f"FINETUNE_STEPS={self.num_steps!r}: must be a positive number "
                               "of solver steps")
        if self.method not in METHODS:
            raise SettingError(f"METHOD={self.method!r}: expected one of {METHODS}")
        require_one_of(self, "mode", MODES)
        require(self, "pretrained_dir", bool(self.pretrained_dir.strip()), "must not be empty")
        require_at_least(self, 1, "lora_rank")
        require_at_least(self, 0, "pretrained_step")
        require_positive(self, "lora_alpha")
        require(self, "lora_targets", bool(self.lora_targets), "must name a layer")

    @property
    def lora(self) -> LoRASpec:
        return LoRASpec(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))


# ------------------------------------------------------------------------------ checks


def check_pretrained(cfg: FinetuneConfig) -> tuple[ModelConfig, int]:
    """(pretrained ModelConfig, checkpoint step); one clear error for a dir without a run."""
    d = cfg.pretrained_dir
    if not os.path.isdir(d):
        raise FileNotFoundError(f"PRETRAINED_DIR={d}: no such directory")
    run = RunDir(d)
    ckpt_dir = run.checkpoints
    steps = run.checkpoint_steps()
    if not steps:
        raise FileNotFoundError(f"PRETRAINED_DIR={d}: no checkpoint under {ckpt_dir}; "
                                "pretrain first (python -m ode_lm.commands.train ...)")
    config = run.model_config()
    if config.architecture != "ode":
        raise ValueError(f"PRETRAINED_DIR={d}: a {config.architecture} model; adaptive-depth "
                         "fine-tuning needs an ODE (DiffEqFormer) run")
    step = cfg.pretrained_step if cfg.pretrained_step is not None else steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"FinetuneConfig.pretrained_step={step}: not in {ckpt_dir} "
                                f"(have {steps})")
    return config, step


def check_tokenizer_match(pretrained: RunDir, data_config: Any, model: ModelConfig) -> None:
    """The fine-tuning data must be tokenized exactly like the pretraining data (prepared
    here if needed: by process 0 first on a multi-host job, so hosts never race on it)."""
    from ode_lm import data as data_lib
    from ode_lm.data.manifest import has_manifest

    ft = prepare_data_once(data_config)
    pretrained_dir = pretrained.path
    pre_dir = pretrained.data_dir()
    if has_manifest(pre_dir):
        pre = data_lib.load_manifest(pre_dir)
        a, b = pre["tokenizer"], ft["tokenizer"]
        if a["sha256"] != b["sha256"] or a["vocab_size"] != b["vocab_size"]:
            raise ValueError(
                f"tokenizer mismatch: the pretrained run {pretrained_dir} used {a['spec']!r} "
                f"(sha256 {a['sha256'][:12]}, {pre_dir}) but the fine-tuning data "
                f"{data_config.data_dir} uses {b['spec']!r} (sha256 {b['sha256'][:12]}); "
                "use DataConfig.tokenizer=" + repr(f"hf:{os.path.join(pre_dir, a['file'])}"
                                                   if a.get("file") else a["spec"])
            )
    if ft["vocab_size"] > model.vocab_size:
        raise ValueError(f"tokenizer mismatch: fine-tuning data {data_config.data_dir} has "
                         f"{ft['vocab_size']} tokens, the pretrained model {model.vocab_size}")


# ------------------------------------------------------------------------------ pieces


def finetune_model_config(pretrained: ModelConfig, cfg: FinetuneConfig) -> ModelConfig:
    if cfg.mode == "materialised":
        return pretrained.replace(architecture="parallel", num_layers=cfg.num_steps)
    return pretrained.replace(num_steps=cfg.num_steps)


def make_model_fn(model_config: ModelConfig, cfg: FinetuneConfig):
    if cfg.method == "lora":
        return lora_model_fn(model_config, cfg.lora)
    return default_model_fn(model_config)


def make_init_params_fn(cfg: FinetuneConfig, model_config: ModelConfig, step: int, seed: int):
    """(abstract params) → the pretrained run's params, materialised / LoRA-wrapped, sharded."""

    def init(abstract_params: Any) -> Any:
        from ode_lm.models.materialize import materialize
        from ode_lm.training.saved_run import load_model

        model, _ = load_model(cfg.pretrained_dir, step)
        if cfg.mode == "materialised":
            model = materialize(model, cfg.num_steps, "euler")
        if cfg.method == "lora":
            model = LoRAModel(model, model_config, cfg.lora, nnx.Rngs(seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        # every process holds the whole (one-CPU) model: each builds its own devices' shards
        # from it (a device_put onto a multi-host sharding would be a cross-host transfer,
        # which the CPU backend refuses)
        return jax.tree.map(lambda x, a: global_from_host(np.asarray(x), a.sharding),
                            params, abstract_params)

    return init


def global_from_host(value: np.ndarray, sharding: Any) -> jax.Array:
    """A global array over ``sharding`` from a host value every process holds whole."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def finetune_info(cfg: FinetuneConfig, step: int) -> dict[str, Any]:
    """``finetune.json``: what ``saved_run.load_model`` needs to rebuild (and merge) the model."""
    return {"pretrained_dir": os.path.abspath(cfg.pretrained_dir), "pretrained_step": step,
            "num_steps": cfg.num_steps, "method": cfg.method, "mode": cfg.mode,
            "train_embeddings": cfg.train_embeddings,
            "lora": {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha,
                     "targets": list(cfg.lora_targets)}}


# ------------------------------------------------------------------------------ entry


def run_finetune(cfg: FinetuneConfig, data: Any, train_config: TrainConfig, *,
                 optimizer_config: OptimizerConfig | None = None,
                 step_config: StepConfig | None = None,
                 checkpoint_config: CheckpointConfig | None = None,
                 mesh_config: MeshConfig | None = None,
                 config_record: ConfigRecord | None = None,
                 evals: list[EvalHook] | None = None,
                 read_run: Callable[[str], RunDir] = RunDir,
                 print_fn: Callable[[str], None] = print) -> tuple[TrainResult, dict[str, Any]]:
    """Build the fine-tuning Trainer and run it; returns (TrainResult, trainable counts).
    ``read_run``: how the pretrained run's directory is read (the gin layer's reads the
    data settings of runs from before ``data_config.json``)."""
    pretrained, step = check_pretrained(cfg)
    check_tokenizer_match(read_run(cfg.pretrained_dir), data, pretrained)
    model_config = finetune_model_config(pretrained, cfg)
    model_fn = make_model_fn(model_config, cfg)  # LoRA targets are checked right here:
    abstract = nnx.eval_shape(lambda: model_fn(nnx.Rngs(0)))
    trainable = lora_trainable(cfg.train_embeddings) if cfg.method == "lora" else None
    n_train, n_total = (param_count(abstract, trainable)[k] for k in ("trainable", "total"))
    print_fn(f"fine-tuning {cfg.pretrained_dir} (step {step}) at M={cfg.num_steps} "
             f"[{cfg.mode}, {cfg.method}]: {n_train:,} trainable of {n_total:,} parameters "
             f"({100.0 * n_train / n_total:.2f}%)")
    info = {"trainable": n_train, "total": n_total, "fraction": n_train / n_total}
    step_config = step_config or StepConfig()
    if cfg.mode == "continuous":
        step_config = dataclasses.replace(step_config, num_steps=cfg.num_steps)
    trainer = Trainer(
        model_config=model_config, data_config=data, train_config=train_config,
        optimizer_config=optimizer_config, step_config=step_config,
        checkpoint_config=checkpoint_config, mesh_config=mesh_config, model_fn=model_fn,
        init_params_fn=make_init_params_fn(cfg, model_config, step, train_config.seed),
        trainable=trainable, config_record=config_record, evals=evals,
        finetune=FinetuneRecord(finetune_info(cfg, step), info), print_fn=print_fn,
    )
    return trainer.run(), info
