"""The training loop: config → mesh → state → data → step → hooks.

It reads top to bottom in that order and never branches on a mode: ``__init__`` builds the
mesh and the abstract state; ``run`` restores (or initialises) the state, then prepares the
data and positions it at the state's step, then loops: get a batch, step, run the hooks due
at this step (``hooks.py``: metrics and the progress line, preemption, saving, evaluation,
each registered with its interval). The run directory's record changes only with training:
a start with nothing to train writes nothing, and the run files come with a start's first
checkpoint (``run_dir.py``). Fine-tuning reuses it by passing ``init_params_fn`` (e.g. load a
pretrained run) and ``trainable`` (e.g. LoRA parameters only); depth sweeps, evaluation and
export reuse the same pieces.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ode_lm import partitioning
from ode_lm.data.manifest import has_manifest
from ode_lm.models.accounting import flops_per_token, param_count
from ode_lm.models.config import ModelConfig
from ode_lm.models.solve import Solve
from ode_lm.training import checkpoint as ckpt_lib
from ode_lm.training import evaluation as evaluation_lib
from ode_lm.training import metric_names, run_lock
from ode_lm.training import metrics as metrics_lib
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib
from ode_lm.training.config import MeshConfig, TrainConfig, ensure_writable, validate
from ode_lm.training.evaluation import EvalContext, EvalHook, Evaluator, LossEval
from ode_lm.training.hooks import Evaluate, Hook, Hooks, Save, StepInfo, StepReader
from ode_lm.training.inputs import (
    EvalData,
    TrainData,
    check_resume_tokenizer,
    check_vocab,
    check_vocab_before_prepare,
    data_scalars,
    default_eval_data,
    default_train_data,
    prepare_data_once,
)
from ode_lm.training.optim import OptimizerConfig, make_optimizer
from ode_lm.training.preemption import PreemptionWatcher, StopNow
from ode_lm.training.run_dir import ConfigRecord, FinetuneRecord, RunDir

log = logging.getLogger("ode_lm.train")


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



def use_compilation_cache(setting: str, model_dir: str) -> str | None:
    """Point jax's persistent compilation cache at ``TrainConfig.compilation_cache_dir``
    (its 'auto': the environment's, else the run's bucket, else the user's cache folder),
    before the run compiles anything; the directory in use, None when off."""
    if setting == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # jax reads it itself
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        if model_dir.startswith("gs://"):
            setting = f"gs://{model_dir[5:].split('/', 1)[0]}/ode_lm/xla_cache"
        else:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
            setting = os.path.join(base, "ode_lm", "xla")
    if not setting:
        return None
    jax.config.update("jax_compilation_cache_dir", setting)
    return setting

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
        self.compilation_cache = use_compilation_cache(train_config.compilation_cache_dir,
                                                       train_config.model_dir)
        if evals is None and train_config.lm_eval_tasks:
            raise ValueError("TrainConfig.lm_eval_tasks: the trainer runs lm-eval through the "
                             "hook it is handed (evals=[..., harness.run.LmEval(...)])")
        step_config = step_config or step_lib.StepConfig()
        if step_config.dropout is None:
            stochastic = model_config.dropout_rate > 0 or model_config.random_grid_offset
            step_config = dataclasses.replace(step_config, dropout=stochastic)
        mesh_config = mesh_config or MeshConfig()
        self.model_config, self.data_config = model_config, data_config
        self.cfg, self.step_config = train_config, step_config
        self.print = print_fn if jax.process_index() == 0 else (lambda _: None)
        self.config_record, self.finetune = config_record, finetune
        self.init_params_fn = init_params_fn
        self.run_dir = RunDir(train_config.model_dir)  # the one of this run: handed on
        self._added: list[tuple[Hook, int]] = []
        # 2. mesh
        self.mesh = partitioning.create_mesh(
            mesh_config.ici_parallelism, mesh_config.dcn_parallelism, devices
        )
        self.rules = partitioning.axis_rules(mesh_config.rule_overrides)
        validate(model_config, data_config, step_config, self.mesh, self.rules)
        ensure_writable(train_config.model_dir)
        # 3. state: abstract state and shardings (restored or initialised in run)
        tx, self.schedule = make_optimizer(optimizer_config or OptimizerConfig(),
                                           train_config.num_train_steps)
        model_fn = model_fn or state_lib.default_model_fn(model_config)
        self.spec = state_lib.build_state_spec(model_fn, tx, self.mesh, self.rules, trainable)
        self.sharding_table = partitioning.sharding_table(self.spec.abstract_params)[0]
        partitioning.log_sharding_table(self.mesh, self.sharding_table)
        partitioning.check_param_annotations(self.spec.abstract_params)
        # 4. data: the default data is prepared and checked in run()'s data step, once
        self.own_data = (train_data is None, eval_data is None)
        self._inputs: dict | None = None  # the default data's tokenizer record (data step)
        self.train_data = train_data or default_train_data
        self.eval_data = eval_data or default_eval_data
        self.evaluator = Evaluator(
            self.spec, lambda: self.eval_data(self.data_config, self.mesh, self.rules),
            model_num_steps=model_config.num_steps, model_solver=model_config.solver,
            model_rtol=model_config.rtol)
        # the in-loop evaluations, in order (default: the loss at TrainConfig's settings)
        self.evals = evals if evals is not None else [LossEval.from_config(train_config)]
        ode = model_config.architecture == "ode"  # a discrete model has no N to table
        self.eval_settings = ({k: v for hook in self.evals
                               for k, v in hook.settings(self.evaluator).items()}
                              if ode else {})
        self.checkpointer = ckpt_lib.Checkpointer(
            self.run_dir, checkpoint_config or ckpt_lib.CheckpointConfig())

    def add_hook(self, hook: Hook, *, every: int = 1) -> None:
        """Run ``hook(StepInfo)`` after every ``every``-th step and the last, after the
        trainer's own hooks (``hooks.py``)."""
        self._added.append((hook, every))

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
            check_vocab_before_prepare(self.model_config, self.data_config)
            manifest = prepare_data_once(self.data_config)
            if resumed:
                check_resume_tokenizer(self.run_dir, self.data_config, manifest)
            self.evaluator.num_batches = check_vocab(self.model_config, self.data_config,
                                                     manifest, evaluate=own_eval)
            self._inputs = {"tokenizer": manifest["tokenizer"]}
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
        if not has_manifest(data_dir):
            return
        manifest = prepare_data_once(self.data_config)
        check_resume_tokenizer(self.run_dir, self.data_config, manifest)
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
                try:
                    return self._run()
                finally:
                    self.checkpointer.close()
            except StopNow as e:  # said once the saves handed over have ended, so truly
                raise StopNow(f"{e}; {self._latest_saved()}") from None

    def _latest_saved(self) -> str:
        """The latest complete checkpoint, as read from disk after a second Ctrl-C."""
        steps = self.run_dir.checkpoint_steps()
        return (f"the latest complete checkpoint is step {steps[-1]}" if steps
                else "no checkpoint was saved")

    def _run(self) -> TrainResult:
        cfg = self.cfg
        # 3. state (an incompatible checkpoint is refused before anything is written; a
        # damaged one falls back to the previous); 4. data, positioned at the state's step
        start, state, resumed = self.restore_or_init()
        self.state = state
        if start >= cfg.num_train_steps:  # the record changes only with training
            self.check_prepared_data()  # a bad data setting is still an error, read-only
            if start == cfg.num_train_steps and self._final_eval_missing(start):
                return self._final_eval_only(start, state)
            self.print(f"nothing to train: MODEL_DIR is at step {start} ≥ "
                       f"TRAIN_STEPS={cfg.num_train_steps}")
            return TrainResult(cfg.model_dir, start, None, None, {}, nothing_to_train=True)
        data_iterator, batches = self.data(start, resumed)
        writer = self._start(start, resumed)
        hooks = self._hooks(writer, saved=start if resumed else None)
        # 5. step, then the hooks due at it
        # the host picks each step's compiled variant of the objective from (seed, step)
        train_step = step_lib.jit_train_step(self.spec, self.schedule, self.step_config,
                                             seed=cfg.seed)
        info = StepInfo(start, cfg.num_train_steps, state, None, data_iterator)
        try:
            with hooks, jax.set_mesh(self.mesh):
                first = next(batches)  # every variant compiled before the first step
                self._report_compile(train_step.compile_all(state, first))
                batches = itertools.chain([first], batches)
                while not info.last:
                    state, outputs = train_step(state, next(batches), info.step)
                    info = StepInfo(info.step + 1, cfg.num_train_steps, state, outputs,
                                    data_iterator)
                    hooks.run(info)
        except StopNow:
            raise StopNow(f"stopped by a second Ctrl-C at step {info.step}") from None
        finally:
            writer.flush()
            writer.close()
        if info.stopped_by is None and self._watcher.reason is not None:
            # a stop asked for after the last step's watcher ran (during the final save or
            # eval): the run still stops as asked, not as a finished run
            info.stopped_by = self._watcher.reason
        self.state = state
        result = TrainResult(cfg.model_dir, info.step, self._metrics.first_loss,
                             self._metrics.last_loss, self._eval.results,
                             eval_settings=self.eval_settings)
        if info.stopped_by is not None:
            result.preempted, result.stopped_by, result.eval = True, info.stopped_by, {}
            self.print(f"stopped by {info.stopped_by} after step {info.step}; "
                       "checkpoint saved")
        self._write_result(result)
        return result

    def _report_compile(self, seconds: dict[tuple, float]) -> None:
        """One line: the step's programs compiled before the first step, seconds each."""
        if not seconds:
            return
        each = ", ".join(f"{s:.1f}" for s in seconds.values())
        self.print(f"compiled {len(seconds)} step program{'s' if len(seconds) > 1 else ''} "
                   f"before the first step: {each} s")

    def _final_eval_missing(self, step: int) -> bool:
        """Whether a run at its last step logged no eval there: its final eval was stopped
        (a Ctrl-C during it), so the summary and its table were never written."""
        if not self.evals:
            return False
        keys = metrics_lib.logged_keys(self.run_dir.metrics, step)
        return not any(metric_names.parse(k) is not None for k in keys)

    def _final_eval_only(self, step: int, state: Any) -> TrainResult:
        """The final eval a stopped run skipped, on its last checkpoint, logged as the loop
        logs it; the result is a finished run's (its summary, table, fine-tune result)."""
        self.print(f"MODEL_DIR is at step {step} = TRAIN_STEPS, but its final eval did not "
                   "run (stopped by Ctrl-C?): running it now")
        own_train, own_eval = self.own_data
        if own_train:  # the data step's checks (and the progress line's batch count)
            manifest = prepare_data_once(self.data_config)
            self.evaluator.num_batches = check_vocab(self.model_config, self.data_config,
                                                     manifest, evaluate=own_eval)
        writer = metrics_lib.create_writer(self.run_dir)
        try:
            with jax.set_mesh(self.mesh):
                results = self.evaluate(state["params"], step)
            self._log_eval(writer, step, results)
        finally:
            writer.flush()
            writer.close()
        result = TrainResult(self.cfg.model_dir, step, None, None, results,
                             eval_settings=self.eval_settings)
        self._write_result(result)
        return result

    def _hooks(self, writer: metrics_lib.MetricWriter, saved: int | None) -> Hooks:
        """This run's hooks, in order (``hooks.py``), then the ones added."""
        cfg, data = self.cfg, self.data_config
        tokens_per_step = data.global_batch_size * data.seq_len
        fpt = flops_per_token(self.model_config, self.step_config.num_steps, seq_len=data.seq_len,
                              tokens_per_batch=tokens_per_step // self.step_config.microbatches)
        peak = metrics_lib.total_peak_flops(list(self.mesh.devices.flat), self.model_config.dtype,
                                            cfg.cpu_peak_flops)
        # FLOPs: fwd + bwd, weight generation included, at the configured N; each step's own
        # count (a term's further solves, a drawn N) replaces it where the step reports one
        window = metrics_lib.MetricWindow(
            tokens_per_step=tokens_per_step, flops_per_token=float(fpt.training),
            peak_flops=peak, total_steps=cfg.num_train_steps)
        self._metrics = StepReader(window, writer, self.print, max_bad_steps=cfg.max_bad_steps,
                                   scalars=data_scalars(data))
        self._saver = Save(self.checkpointer, self._metrics, self._write_run_files, saved=saved)
        self._watcher = PreemptionWatcher()
        self._eval = Evaluate(self.evaluate, lambda step, results: self._log_eval(
            writer, step, results), self._metrics, final=self._watcher.interruptible)
        hooks = Hooks()
        hooks.add(self._metrics.read, every=1)
        hooks.add(self._metrics.log, every=cfg.log_every)
        hooks.add(self._watcher, every=1)
        hooks.add(self._saver, every=1)
        hooks.add(self._eval, every=cfg.eval_every or cfg.num_train_steps)
        for hook, every in self._added:
            hooks.add(hook, every=every)
        return hooks

    # ------------------------------------------------------------- the record
    def _start(self, start: int, resumed: bool) -> metrics_lib.MetricWriter:
        """This start's record: the config it keeps (written with its first checkpoint),
        the metrics after the checkpoint it resumes from dropped, the writer (the config
        shown in TensorBoard), and its first line."""
        self._record = self._start_record(start, resumed)
        self._trim_metrics(start)
        writer = metrics_lib.create_writer(self.run_dir)
        if self.config_record is not None:
            record = self.config_record
            writer.write_texts(start, {"config": record.markdown(record.text())})
        num_params = param_count(self.spec.abstract_params)["total"]
        self.print(
            f"{'resumed from' if resumed else 'initialised at'} step {start} | mesh "
            f"{dict(self.mesh.shape)} | {num_params:,} parameters"
        )
        return writer

    def _log_eval(self, writer, step: int, results: dict[str, float]) -> None:
        writer.write_scalars(step, results)
        shown = [f"{k} {v:.4f}" for k, v in results.items()
                 if not (metric_names.is_metric(k, "tokens", "nfe")
                         or k.startswith(metric_names.GAP_PREFIX))]
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
        previous = self.run_dir.config_at(start)
        if previous is None:
            return start, text
        changes = self.config_record.changes(previous[1], text, model_dir=self.cfg.model_dir)
        if not changes:
            return None
        name = os.path.basename(self.run_dir.start_config(start))
        self.print(f"settings changed at step {start} ({name}): {', '.join(changes)}")
        return start, text

    def _trim_metrics(self, start: int) -> None:
        """Drop metrics logged after the checkpoint this start resumes from: one timeline."""
        if jax.process_index() != 0:
            return
        dropped = metrics_lib.trim_after(self.run_dir.metrics, self.run_dir.event_files(), start)
        if dropped:
            self.print(f"dropped {dropped} metrics rows logged after step {start}, the "
                       "checkpoint this run resumes from")

    def _write_run_files(self) -> None:
        """With this start's first checkpoint: the record says what it was trained with."""
        if jax.process_index() != 0:
            return
        self.run_dir.write_run_files(
            self.model_config, self.data_config, self._record,
            sharding=partitioning.sharding_text(self.mesh, self.sharding_table),
            finetune=self.finetune.info if self.finetune is not None else None,
            inputs=self._inputs)

    def _write_result(self, result: TrainResult) -> None:
        """A fine-tune's result (its counts, final step and eval), still under the lock."""
        if self.finetune is None or jax.process_index() != 0:
            return
        self.run_dir.write_finetune_result(
            {**self.finetune.counts, "step": result.step, "eval": result.eval})
