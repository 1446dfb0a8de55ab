"""The training loop: config → mesh → state → data → step → checkpoints + metrics.

It reads top to bottom in that order and never branches on a mode: ``__init__`` builds the
mesh and the abstract state; ``run`` restores (or initialises) the state, then prepares the
data and positions it at the state's step, then steps, saving and evaluating. The run
directory's record changes only with training: a start with nothing to train writes nothing,
and the run files come with a start's first checkpoint (``run_dir.py``). Fine-tuning
reuses it by passing ``init_params_fn`` (e.g. load a pretrained run) and ``trainable`` (e.g.
LoRA parameters only); depth sweeps, evaluation and export reuse the same pieces.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax

from ode_lm import partitioning
from ode_lm.config_types import check_types
from ode_lm.models.accounting import param_count
from ode_lm.models.config import ModelConfig
from ode_lm.training import checkpoint as ckpt_lib
from ode_lm.training import evaluation as evaluation_lib
from ode_lm.training import metrics as metrics_lib
from ode_lm.training import run_lock
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib
from ode_lm.training.evaluation import (
    EvalContext,
    EvalHook,
    Evaluator,
    LossEval,
    Solve,
    parse_solve,
)
from ode_lm.training.optim import OptimizerConfig, make_optimizer
from ode_lm.training.preemption import PreemptionWatcher, StopNow
from ode_lm.training.run_dir import FinetuneRecord, RunDir

log = logging.getLogger("ode_lm.train")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings (gin: ``TrainConfig.*``)."""

    model_dir: str
    num_train_steps: int
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only after the last step
    eval_num_steps: tuple[int, ...] = ()  # depth sweep: also eval at these ODE step counts
    eval_solver: str | None = None  # solver for the eval and the depth sweep (None: model's)
    # more settings at every eval, in the words their names write after '@' (e.g. 'rk4:steps=8',
    # 'adaptive:rtol=1e-3'; 'steps=8' is the model's own solver): training.evaluation.Solve
    eval_solves: tuple[str, ...] = ()
    max_bad_steps: int = 10  # abort after this many consecutive NaN/Inf steps
    # None: the CPU's peak, probed once per machine (hardware.cpu_peak_flops)
    cpu_peak_flops: float | None = None
    # lm-eval tasks (names or YAML files) run at each eval: lm_eval/<task>/<metric>, by the
    # hook the gin layer hands the trainer (harness.run.LmEval)
    lm_eval_tasks: tuple[str, ...] = ()
    lm_eval_include_path: str | None = None  # a directory of local task YAMLs
    lm_eval_limit: int | None = None  # documents per task (None: all)

    def __post_init__(self):
        check_types(self)
        if self.num_train_steps < 1:
            raise ValueError(f"TrainConfig.num_train_steps={self.num_train_steps}: must be >= 1")
        if self.log_every < 1:
            raise ValueError(f"TrainConfig.log_every={self.log_every}: must be >= 1")
        for spec in self.eval_solves:
            parse_solve(spec, "TrainConfig.eval_solves")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape (gin: ``MeshConfig.*``); one -1 per tuple is filled in."""

    ici_parallelism: tuple[int, int, int] = (1, -1, 1)
    dcn_parallelism: tuple[int, int, int] = (1, 1, 1)
    rule_overrides: tuple = ()  # ((logical axis, mesh axes), ...) replacing table entries

    def __post_init__(self):
        check_types(self)


@dataclasses.dataclass
class TrainResult:
    model_dir: str
    step: int
    first_loss: float | None
    last_loss: float | None
    eval: dict[str, float]
    preempted: bool = False  # stopped early (SIGTERM, Ctrl-C, a pod's preemption), saved
    stopped_by: str | None = None  # "SIGTERM", "Ctrl-C" or "preemption"
    nothing_to_train: bool = False  # MODEL_DIR was at num_train_steps already: untouched
    # the final eval's settings of an ODE model (name suffix -> Solve): the summary's table
    eval_settings: dict[str, Solve] = dataclasses.field(default_factory=dict)


# The input side, injectable so fine-tuning or tests can bring their own batches.
# train: (data_config, mesh, rules, start_step) -> (checkpointable iterator or None, batches)
TrainData = Callable[..., tuple[Any, Iterator[dict]]]
# eval: (data_config, mesh, rules) -> iterable of global batches (finite, loss-masked)
EvalData = Callable[..., Any]


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


def validate(model: ModelConfig, data: Any, step_cfg: step_lib.StepConfig, mesh, rules) -> None:
    """Configuration errors that would otherwise surface deep inside compilation; the batch
    split is the run's (``rules`` with its MeshConfig.rule_overrides), not the default one."""
    shards = partitioning.batch_shards(mesh, rules)
    axes = partitioning.logical_to_mesh(("activation_batch",), rules)[0]
    batch = data.global_batch_size
    if batch % shards:
        raise ValueError(
            f"DataConfig.global_batch_size={batch} is not divisible by the {shards} batch "
            f"shards (activation_batch -> {axes} on mesh {dict(mesh.shape)})"
        )
    if batch % (shards * step_cfg.microbatches):
        raise ValueError(
            f"DataConfig.global_batch_size={batch} is not divisible by batch shards x "
            f"StepConfig.microbatches = {shards * step_cfg.microbatches}"
        )
    if data.seq_len > model.max_seq_len:
        raise ValueError(
            f"DataConfig.seq_len={data.seq_len} exceeds the model's positions "
            f"ModelConfig.max_seq_len={model.max_seq_len}"
        )


def default_model_fn(config: ModelConfig):
    from ode_lm.models import build_model

    return lambda rngs: build_model(config, rngs)


def flops_per_token(
    config: ModelConfig, num_steps: int | None, seq_len: int, tokens_per_batch: int
) -> float:
    """Model training FLOPs per token (fwd + bwd, weight generation included)."""
    from ode_lm.models.accounting import flops_per_token as fpt

    counts = fpt(config, num_steps, seq_len=seq_len, tokens_per_batch=tokens_per_batch)
    return float(counts.training)


class ConfigRecord(Protocol):
    """The run's operative config, from the config layer (gin: ``gin_setup.GinRecord``):
    kept with the start's first checkpoint, shown in TensorBoard, compared on resume."""

    def text(self) -> str: ...

    def markdown(self, text: str) -> str: ...

    def changes(self, old: str, new: str, model_dir: str | None = None) -> list[str]: ...


class Trainer:
    """Wires the pieces together. Build it, call ``run()``."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        data_config: Any,
        train_config: TrainConfig,
        optimizer_config: OptimizerConfig | None = None,
        step_config: step_lib.StepConfig | None = None,
        checkpoint_config: ckpt_lib.CheckpointConfig | None = None,
        mesh_config: MeshConfig | None = None,
        devices: list | None = None,
        train_data: TrainData | None = None,
        eval_data: EvalData | None = None,
        model_fn: state_lib.ModelFn | None = None,
        init_params_fn: state_lib.InitParamsFn | None = None,
        trainable: state_lib.TrainablePredicate | None = None,
        config_record: ConfigRecord | None = None,
        evals: list[EvalHook] | None = None,
        finetune: FinetuneRecord | None = None,
        print_fn: Callable[[str], None] = print,
    ):
        if evals is None and train_config.lm_eval_tasks:
            raise ValueError("TrainConfig.lm_eval_tasks: the trainer runs lm-eval through the "
                             "hook it is handed (evals=[..., harness.run.LmEval(...)])")
        optimizer_config = optimizer_config or OptimizerConfig()
        step_config = step_config or step_lib.StepConfig()
        if step_config.dropout is None:
            stochastic = model_config.dropout_rate > 0 or model_config.random_grid_offset
            step_config = dataclasses.replace(step_config, dropout=stochastic)
        checkpoint_config = checkpoint_config or ckpt_lib.CheckpointConfig()
        mesh_config = mesh_config or MeshConfig()
        self.model_config = model_config
        self.data_config = data_config
        self.cfg = train_config
        self.step_config = step_config
        self.print = print_fn if jax.process_index() == 0 else (lambda _: None)
        self.config_record = config_record
        self.init_params_fn = init_params_fn
        self.finetune = finetune
        # 2. mesh
        self.mesh = partitioning.create_mesh(
            mesh_config.ici_parallelism, mesh_config.dcn_parallelism, devices
        )
        self.rules = partitioning.axis_rules(mesh_config.rule_overrides)
        validate(model_config, data_config, step_config, self.mesh, self.rules)
        ensure_writable(train_config.model_dir)
        # 3. state: abstract state and shardings (restored or initialised in run)
        tx, self.schedule = make_optimizer(optimizer_config, train_config.num_train_steps)
        self.spec = state_lib.build_state_spec(
            model_fn or default_model_fn(model_config), tx, self.mesh, self.rules, trainable
        )
        table, _, _ = partitioning.sharding_table(self.spec.abstract_params)
        partitioning.log_sharding_table(self.mesh, table)
        self.sharding_table = table
        partitioning.check_param_annotations(self.spec.abstract_params)
        # the default data is prepared and checked in run()'s data step, once
        self.own_data = (train_data is None, eval_data is None)
        self.train_data = train_data or default_train_data
        self.eval_data = eval_data or default_eval_data
        self.evaluator = Evaluator(
            self.spec, lambda: self.eval_data(self.data_config, self.mesh, self.rules),
            model_num_steps=model_config.num_steps, model_solver=model_config.solver)
        # the in-loop evaluations, in order (default: the loss at TrainConfig's settings)
        self.evals = evals if evals is not None else [LossEval.from_config(train_config)]
        ode = model_config.architecture == "ode"  # a discrete model has no N to table
        self.eval_settings = ({k: v for hook in self.evals
                               for k, v in hook.settings(self.evaluator).items()}
                              if ode else {})
        self.checkpointer = ckpt_lib.Checkpointer(train_config.model_dir, checkpoint_config)

    # ------------------------------------------------------------------ pieces
    def restore_or_init(self) -> tuple[int, dict, bool]:
        """(step, state, resumed): the latest complete checkpoint onto this mesh (its
        metadata read once, here), else init (or the injected params) at step 0."""
        step, state = self.checkpointer.restore_latest(self.spec.abstract_state)
        if step is not None:
            return step, state, True
        if self.init_params_fn is not None:
            params = self.init_params_fn(self.spec.abstract_params)
            return 0, state_lib.state_from_params(self.spec, params, self.cfg.seed), False
        return 0, state_lib.init_state(self.spec, self.cfg.seed), False

    def data(self, start: int, resumed: bool) -> tuple[Any, Iterator[dict]]:
        """(iterator, global batches) at ``start``: the default data prepared once (process 0
        first, one barrier) and checked against the model, then the iterator's saved state
        restored when the checkpoint has one for this process layout."""
        own_train, own_eval = self.own_data
        if own_train:
            manifest = prepare_data_once(self.data_config)
            self.evaluator.num_batches = check_vocab(self.model_config, self.data_config,
                                                     manifest, evaluate=own_eval)
        data_iterator, batches = self.train_data(self.data_config, self.mesh, self.rules, start)
        if resumed and not self.checkpointer.restore_data(start, data_iterator):
            log.warning("no data iterator state at step %d: using the step-derived position", start)
        return data_iterator, batches

    def check_prepared_data(self) -> None:
        """The data step's checks against an already prepared DATA_DIR, reading only (a
        missing one is not prepared: there is nothing to train)."""
        own_train, own_eval = self.own_data
        data_dir = getattr(self.data_config, "data_dir", None)
        if not own_train or not data_dir or getattr(self.data_config, "streaming", False):
            return
        if not os.path.exists(os.path.join(data_dir, "manifest.json")):
            return
        manifest = prepare_data_once(self.data_config)
        check_vocab(self.model_config, self.data_config, manifest, evaluate=own_eval)

    def evaluate(self, params: Any, step: int) -> dict[str, float]:
        """Every in-loop evaluation it was handed, in order, on the current parameters; for
        an ODE run also the drift, ``eval/depth_gap/<setting>`` over its settings."""
        ctx = EvalContext(step, params, self.spec, self.data_config, self.evaluator, self.rules)
        results: dict[str, float] = {}
        for hook in self.evals:
            results.update(hook(ctx))
        results.update(evaluation_lib.depth_gaps(results, self.eval_settings))  # ODE: the drift
        return results

    # -------------------------------------------------------------------- loop
    def run(self) -> TrainResult:
        """The loop, holding MODEL_DIR's run lock (process 0) from before its first write."""
        with run_lock.hold(self.cfg.model_dir, primary=jax.process_index() == 0):
            try:
                return self._run()
            finally:
                self.checkpointer.close()

    def _run(self) -> TrainResult:
        cfg = self.cfg
        # 3. state (an incompatible checkpoint is refused before anything is written; a
        # damaged one falls back to the previous); 4. data, positioned at the state's step
        start, state, resumed = self.restore_or_init()
        self.state = state
        if start >= cfg.num_train_steps:  # the record changes only with training
            self.check_prepared_data()  # a bad data setting is still an error, read-only
            self.print(f"nothing to train: MODEL_DIR is at step {start} ≥ "
                       f"TRAIN_STEPS={cfg.num_train_steps}")
            return TrainResult(cfg.model_dir, start, None, None, {}, nothing_to_train=True)
        data_iterator, batches = self.data(start, resumed)
        self._record = self._start_record(start, resumed)
        self._recorded = False
        self._trim_metrics(start)
        writer = metrics_lib.create_writer(cfg.model_dir)
        if self.config_record is not None:
            record = self.config_record
            writer.write_texts(start, {"config": record.markdown(record.text())})
        num_params = param_count(self.spec.abstract_params)["total"]
        self.print(
            f"{'resumed from' if resumed else 'initialised at'} step {start} | mesh "
            f"{dict(self.mesh.shape)} | {num_params:,} parameters"
        )
        # 5. step
        train_step = step_lib.jit_train_step(self.spec, self.schedule, self.step_config,
                                             seed=cfg.seed)
        tokens_per_step = self.data_config.global_batch_size * self.data_config.seq_len
        peak = metrics_lib.total_peak_flops(
            list(self.mesh.devices.flat), self.model_config.dtype, cfg.cpu_peak_flops
        )
        fpt = _safe_flops_per_token(
            self.model_config, self.step_config.num_steps, self.data_config.seq_len,
            tokens_per_step // self.step_config.microbatches,
        )
        window = metrics_lib.MetricWindow(tokens_per_step=tokens_per_step, flops_per_token=fpt,
                                          peak_flops=peak, total_steps=cfg.num_train_steps)
        reader = metrics_lib.StepReader(window, writer, self.print, log_every=cfg.log_every,
                            total_steps=cfg.num_train_steps, max_bad_steps=cfg.max_bad_steps,
                            scalars=data_scalars(self.data_config))
        watcher = PreemptionWatcher().install()
        result = TrainResult(cfg.model_dir, start, None, None, {},
                             eval_settings=self.eval_settings)
        step, self._saved = start, (start if resumed else None)
        try:
            with jax.set_mesh(self.mesh):
                while step < cfg.num_train_steps:
                    state, outputs = train_step(state, next(batches), step)
                    step += 1
                    reader.push(step, outputs)  # reads the previous step's outputs
                    if self.checkpointer.should_save(step):
                        # the save waits for this step's state anyway: log it first, so a
                        # crash after the checkpoint leaves no gap in the metrics
                        reader.drain(dispatched=step)
                    self._save(step, state, data_iterator)
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.num_train_steps:
                        reader.drain(dispatched=step)
                        self._log_eval(writer, step, self.evaluate(state["params"], step))
                        window.restart()
                    if watcher.should_stop(step):
                        result.preempted, result.stopped_by = True, watcher.reason
                        break
                reader.drain(dispatched=step)
            self._save(step, state, data_iterator, force=True)
            self.checkpointer.wait()
            result.step = step
            result.first_loss, result.last_loss = reader.first_loss, reader.last_loss
            if result.preempted:
                self.print(f"stopped by {result.stopped_by} after step {step}; "
                           "checkpoint saved")
            else:
                result.eval = self.evaluate(state["params"], step)
                self._log_eval(writer, step, result.eval)
            self._write_result(result)
        except StopNow:
            kept = (f"the latest checkpoint is step {self._saved}" if self._saved is not None
                    else "nothing was saved")
            raise StopNow(f"stopped by a second Ctrl-C at step {step}: not saved; {kept}"
                          ) from None
        finally:
            watcher.uninstall()
            writer.flush()
            writer.close()
        self.state = state
        return result

    # ----------------------------------------------------------------- helpers
    def _log_eval(self, writer, step: int, results: dict[str, float]) -> None:
        writer.write_scalars(step, results)
        shown = [f"{k} {v:.4f}" for k, v in results.items()
                 if not k.startswith(("eval/tokens", "eval/nfe", evaluation_lib.GAP_PREFIX))]
        gap = evaluation_lib.gap_summary(results)  # the drift, compact: the largest gap
        self.print(" | ".join([f"eval @ step {step}", *shown, *([gap] if gap else [])]))

    def _start_record(self, start: int, resumed: bool) -> tuple[int, str] | None:
        """(start, operative config) when this start's config is to be kept: a first start,
        or a resume whose settings differ from those the checkpoint was trained with (said
        in one line); None otherwise. Written with this start's first checkpoint."""
        if self.config_record is None or jax.process_index() != 0:
            return None
        text = self.config_record.text()
        if not resumed:
            return 0, text
        previous = RunDir(self.cfg.model_dir).config_at(start)
        if previous is None:
            return start, text
        changes = self.config_record.changes(previous[1], text, model_dir=self.cfg.model_dir)
        if not changes:
            return None
        name = os.path.basename(RunDir(self.cfg.model_dir).start_config(start))
        self.print(f"settings changed at step {start} ({name}): {', '.join(changes)}")
        return start, text

    def _trim_metrics(self, start: int) -> None:
        """Drop metrics logged after the checkpoint this start resumes from: one timeline."""
        if jax.process_index() != 0:
            return
        run = RunDir(self.cfg.model_dir)
        dropped = metrics_lib.trim_after(run.metrics, run.event_files(), start)
        if dropped:
            self.print(f"dropped {dropped} metrics rows logged after step {start}, the "
                       "checkpoint this run resumes from")

    def _save(self, step: int, state: Any, data_iterator: Any, force: bool = False) -> None:
        """A checkpoint (on the interval, or ``force``); this start's first one also writes
        the run files: the record says what the checkpoints were trained with."""
        if not self.checkpointer.save(step, state, data_iterator, force=force):
            return
        self._saved = step
        if not self._recorded:
            self._recorded = True
            self._write_run_files()

    def _write_run_files(self) -> None:
        if jax.process_index() != 0:
            return
        RunDir(self.cfg.model_dir).write_run_files(
            self.model_config, self.data_config, self._record,
            sharding=partitioning.sharding_text(self.mesh, self.sharding_table),
            finetune=self.finetune.info if self.finetune is not None else None)

    def _write_result(self, result: TrainResult) -> None:
        """A fine-tune's result (its counts, final step and eval), still under the lock."""
        if self.finetune is None or jax.process_index() != 0:
            return
        RunDir(self.cfg.model_dir).write_finetune_result(
            {**self.finetune.counts, "step": result.step, "eval": result.eval})


def _safe_flops_per_token(config: ModelConfig, num_steps: int | None, seq_len: int,
                          tokens_per_batch: int) -> float:
    try:
        return flops_per_token(config, num_steps, seq_len, tokens_per_batch)
    except ImportError:
        log.warning("ode_lm.models.accounting not available: MFU reported as NaN")
        return float("nan")


# ----------------------------------------------------------------- default data


def prepare_data_once(data_config: Any, sync: Callable[[str], None] | None = None) -> dict:
    """``ensure_prepared`` for a multi-host job: process 0 prepares the (shared) DATA_DIR
    while the others wait at a barrier, so hosts never race to write the same shards; a
    host that still finds no manifest afterwards (a per-host local DATA_DIR) prepares its
    own copy. Returns the manifest."""
    from ode_lm import data as data_lib

    if jax.process_count() > 1:
        if jax.process_index() == 0:
            data_lib.ensure_prepared(data_config)
        if sync is None:
            from jax.experimental import multihost_utils

            sync = multihost_utils.sync_global_devices
        sync("ode_lm: data prepared by process 0")
    return data_lib.ensure_prepared(data_config)


def default_train_data(data_config: Any, mesh, rules, start_step: int):
    """The grain train pipeline of ode_lm.data over the prepared DATA_DIR (the trainer's data
    step has run ``prepare_data_once``), as global arrays sharded over the batch."""
    from ode_lm import data as data_lib

    iterator = data_lib.make_train_iterator(data_config, start_step=start_step)
    return iterator, (data_lib.to_global_batch(b, mesh, rules) for b in iterator)


def data_scalars(data_config: Any) -> Callable[[int], dict[str, float]]:
    """The data's figures after a step (a mixture: ``data/<component>/tokens``, cumulative,
    a pure function of the config and the step; else none)."""
    from ode_lm import data as data_lib

    return data_lib.TokenCount(data_config)


def default_eval_data(data_config: Any, mesh, rules):
    """Every validation batch once (padded, loss-masked), as global arrays."""
    from ode_lm import data as data_lib

    iterator = data_lib.make_eval_iterator(data_config)
    return (data_lib.to_global_batch(b, mesh, rules) for b in iterator)


def check_vocab(model_config: ModelConfig, data_config: Any, manifest: dict,
                evaluate: bool = True) -> int | None:
    """Before any step: the model's vocabulary covers the prepared data's token ids, and (with
    the default eval data) the validation split holds at least one eval batch (returned:
    their number), from the manifest alone (``prepare_data_once`` has checked the data dir
    itself)."""
    from ode_lm import data as data_lib

    if manifest["vocab_size"] > model_config.vocab_size:
        raise ValueError(
            f"ModelConfig.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"{manifest['vocab_size']} ({data_config.tokenizer} in {data_config.data_dir})"
        )
    if evaluate:  # the eval batches, for the eval's progress line
        return data_lib.check_eval_split(data_config, manifest)
    return None

