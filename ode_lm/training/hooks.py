"""The train loop's hooks (levanter's ``add_hook(..., every=N)``): the loop only gets a
batch, steps and runs the hooks due at that step; all else it does is a hook.

``Hooks.add(hook, every=N)`` runs ``hook(info)`` after every N-th step and after the run's
last step, in the order added; a hook that is a context manager is entered around the loop
(``with hooks:``). A hook stops the run by setting ``info.stopped_by``: the hooks after it
see ``info.last`` and the loop ends after this step. The trainer adds, in this order:

======================  ===============  ==================================================
hook                    every            what
======================  ===============  ==================================================
``StepReader.read``     1                the step before this one read back (one step late:
                                         the loop never waits on the step it dispatched):
                                         NaN/Inf streak, metric window
``StepReader.log``      ``log_every``    this step's metrics row and progress line, written
                                         when its outputs are read
``PreemptionWatcher``   1                SIGTERM, Ctrl-C, a pod's preemption: stop after
                                         this step (``preemption.py``)
``Save``                1                a checkpoint when orbax says, and at the last step
                                         or a stop; the start's first also writes the run
                                         files
``Evaluate``            ``eval_every``   the in-loop evaluations and their depth gap; at
                        (0: the last)    the last step, the final eval
======================  ===============  ==================================================

then the ones handed to ``Trainer.add_hook``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ode_lm.training.metrics import MetricWindow, MetricWriter
from ode_lm.training.preemption import StopEval


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step."""

    step: int  # steps done: this one dispatched, maybe still running
    total_steps: int
    state: Any  # the train state after it, on device (the next step donates it)
    outputs: Any  # its outputs, on device
    data: Any = None  # the checkpointable data iterator (None: batches without a state)
    stopped_by: str | None = None  # a hook's stop: "SIGTERM", "Ctrl-C" or "preemption"

    @property
    def last(self) -> bool:
        """The run ends after this step: its last step, or a stop."""
        return self.step >= self.total_steps or self.stopped_by is not None


Hook = Callable[[StepInfo], None]


class Hooks:
    """The loop's hooks in the order added, each with its interval."""

    def __init__(self) -> None:
        self._hooks: list[tuple[Hook, int]] = []
        self._entered = contextlib.ExitStack()

    def add(self, hook: Hook, *, every: int = 1) -> None:
        """Run ``hook(info)`` after every ``every``-th step and after the run's last step."""
        if every < 1:
            raise ValueError(f"every={every}: must be >= 1")
        self._hooks.append((hook, every))

    def run(self, info: StepInfo) -> None:
        """The hooks due after ``info.step``, in the order added."""
        for hook, every in self._hooks:
            if info.step % every == 0 or info.step >= info.total_steps:
                hook(info)

    def __enter__(self) -> Hooks:
        for hook, _ in self._hooks:
            if hasattr(hook, "__enter__"):
                self._entered.enter_context(hook)  # e.g. the watcher's signal handlers
        return self

    def __exit__(self, *exc: Any) -> None:
        self._entered.close()


class StepReader:
    """The metrics hooks: the host side of finished steps, one step late. ``read`` (every
    step, right after it is dispatched) reads the step before it while this one runs:
    checks the NaN/Inf streak and adds it to the metric window; ``log`` (every ``log_every``)
    has this step's row and progress line written when it is read; ``drain`` reads the held
    step now (before a save or an eval)."""

    def __init__(self, window: MetricWindow, writer: MetricWriter,
                 print_fn: Callable[[str], None], *, max_bad_steps: int,
                 scalars: Callable[[int], dict[str, float]] | None = None):
        """``scalars(step)``: more figures logged with each row (the data's, e.g. a
        mixture's ``data/<component>/tokens``)."""
        self.window, self.writer, self.print = window, writer, print_fn
        self.scalars = scalars or (lambda step: {})
        self.max_bad_steps = max_bad_steps
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._held: tuple[int, dict] | None = None  # (step, device outputs) not read yet
        self._log: set[int] = set()  # steps whose row is written when read

    def read(self, info: StepInfo) -> None:
        self.push(info.step, info.outputs)

    def log(self, info: StepInfo) -> None:
        self._log.add(info.step)

    def push(self, step: int, outputs: dict) -> None:
        """Step ``step`` was just dispatched: read the one before it, hold this one."""
        self.drain(dispatched=step)
        self._held = (step, outputs)

    def drain(self, *, dispatched: int) -> None:
        """Read the held step, if any (``dispatched``: steps dispatched so far)."""
        if self._held is None:
            return
        (step, outputs), self._held = self._held, None
        outputs = jax.device_get(outputs)
        loss = float(outputs["loss"])
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        if int(outputs["bad_streak"]) >= self.max_bad_steps:
            raise FloatingPointError(
                f"{int(outputs['bad_streak'])} consecutive steps had a NaN/Inf loss or "
                f"gradient (last at step {step}); aborting. Lower the learning rate or "
                "check the data."
            )
        self.window.add(outputs, dispatched=dispatched)
        if step in self._log:
            self._log.discard(step)
            self.print(self.window.log(step, self.writer, self.scalars(step)))


class Save:
    """The checkpoint hook (every step). ``Checkpointer.save`` first surfaces a failed
    async save, then writes when orbax says (the interval, a pod's preemption sync point)
    and, forced, at the run's last step or a stop, which also waits for the write. The held
    metrics are read first, so a crash after a checkpoint leaves no gap in them; this
    start's first checkpoint also writes the run files (what the checkpoints were trained
    with), once that checkpoint is complete on disk: a save that fails leaves no config
    behind that no checkpoint was trained with."""

    def __init__(self, checkpointer: Any, metrics: StepReader,
                 write_run_files: Callable[[], None], *, saved: int | None):
        self.checkpointer, self.metrics = checkpointer, metrics
        self._write_run_files: Callable[[], None] | None = write_run_files
        self._files_for: int | None = None  # the save the run files wait for
        self.saved = saved  # the latest checkpoint's step handed to the save (None: none yet)

    def __call__(self, info: StepInfo) -> None:
        ckpt = self.checkpointer
        if info.last or ckpt.should_save(info.step):
            self.metrics.drain(dispatched=info.step)
        try:
            if ckpt.save(info.step, info.state, info.data, force=info.last):
                self.saved = info.step
                if self._write_run_files is not None and self._files_for is None:
                    self._files_for = info.step
            if info.last:
                ckpt.wait()
        except Exception:  # a later save failed: an earlier complete one keeps its record
            self._record_written()
            raise
        self._record_written(done=info.last)

    def _record_written(self, done: bool = False) -> None:
        """The run files, once the checkpoint they wait for is complete (``done``: every
        save handed over has been waited for)."""
        if self._files_for is not None and (done or self.checkpointer.is_written(
                self._files_for)):
            self._write_run_files()
            self._write_run_files = self._files_for = None


class Evaluate:
    """The eval hook (every ``eval_every`` steps, and the last: the final eval; none at a
    stop): ``evaluate(params, step)``, then ``log(step, results)``. The held metrics are
    read first and the window restarted after, so no step is timed with an eval in it."""

    def __init__(self, evaluate: Callable[[Any, int], dict[str, float]],
                 log: Callable[[int, dict[str, float]], None], metrics: StepReader,
                 final: Callable[[], contextlib.AbstractContextManager] | None = None):
        """``final``: the context the final eval runs in (``PreemptionWatcher.interruptible``:
        a Ctrl-C there ends it at once with ``StopEval``, the stop this hook then records)."""
        self.evaluate, self.log, self.metrics = evaluate, log, metrics
        self.final = final or contextlib.nullcontext
        self.results: dict[str, float] = {}  # the latest eval's

    def __call__(self, info: StepInfo) -> None:
        if info.stopped_by is not None:
            return
        self.metrics.drain(dispatched=info.step)
        try:
            with self.final() if info.step >= info.total_steps else contextlib.nullcontext():
                self.results = self.evaluate(info.state["params"], info.step)
        except StopEval:  # the last step is saved: the run stops as after any step
            info.stopped_by, self.results = "Ctrl-C", {}
            return
        self.log(info.step, self.results)
        self.metrics.window.restart()
