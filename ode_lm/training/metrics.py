"""Metrics: clu aggregation, TensorBoard writers (with or without TensorFlow), MFU, progress.

Values are read back from the device one step late, by the loop's metrics hook
(``hooks.StepReader``), so the host never waits on the step it has just dispatched. Only
process 0 writes event files.

Longer than ~400 lines on purpose: the whole way of a train figure, from the step's outputs
(the window) through its writers to the trim on resume and the progress line, in one place.
"""

from __future__ import annotations

import abc
import functools
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from clu import metrics as clu_metrics

from ode_lm import hardware
from ode_lm.training.run_dir import RunDir


def peak_flops_per_device(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Peak FLOP/s of one accelerator from its ``device_kind`` (the one chip table,
    ``hardware.chip_spec``); None if not in the table."""
    spec = hardware.chip_spec(device_kind)
    return None if spec is None else spec.peak_flops(dtype)


def total_peak_flops(
    devices: list[jax.Device], dtype: str, cpu_peak_flops: float | None = None
) -> float:
    """Peak FLOP/s of the whole mesh. Simulated CPU devices share one host: the CPU peak
    (``cpu_peak_flops``; unset, 0 or None: the probed one) per process."""
    if devices[0].platform == "cpu":
        per_process = cpu_peak_flops or hardware.cpu_peak_flops()
        return per_process * len({d.process_index for d in devices})
    per_device = peak_flops_per_device(devices[0].device_kind, dtype)
    if per_device is None:
        return float("nan")
    return per_device * len(devices)


def mfu(flops_per_token: float, tokens_per_second: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak."""
    return flops_per_token * tokens_per_second / peak_flops


# ------------------------------------------------------------------------ clu metrics


# Per-step train outputs averaged (or last value) over a logging window.
_TRAIN_FIELDS = dict(
    loss=clu_metrics.Average.from_output("loss"),
    grad_norm=clu_metrics.Average.from_output("grad_norm"),
    param_norm=clu_metrics.LastValue.from_output("param_norm"),
    learning_rate=clu_metrics.LastValue.from_output("learning_rate"),
    skipped_steps=clu_metrics.LastValue.from_output("skipped_steps"),
    num_steps=clu_metrics.Average.from_output("num_steps"),
)
TRAIN_METRIC_KEYS = tuple(_TRAIN_FIELDS)
# Every other output of a step is averaged over the steps that output it: the objective's
# terms' metrics (a term that ran on a share of the steps reports on those; a term of the
# user's logs its own), and the FLOPs per token of what each step ran. These two are read
# elsewhere (the NaN streak; the tokens count) and not averaged.
NOT_AVERAGED = ("bad_streak", "tokens")


@functools.cache
def _train_metrics() -> Any:
    return clu_metrics.Collection.create(**_TRAIN_FIELDS)


@functools.cache
def _optional_metric(key: str) -> Any:
    return clu_metrics.Collection.create(**{key: clu_metrics.Average.from_output(key)})


def accumulate(window: dict | None, outputs: Mapping[str, Any]) -> dict:
    """Merge one step's host-side outputs into the logging window (a collection per part:
    the fields every step has, and each optional one over the steps that had it)."""
    window = dict(window or {})
    parts = {"": _train_metrics().single_from_model_output(
        **{k: np.asarray(outputs[k], np.float32) for k in TRAIN_METRIC_KEYS})}
    for k in outputs:
        if k not in TRAIN_METRIC_KEYS and k not in NOT_AVERAGED:
            parts[k] = _optional_metric(k).single_from_model_output(
                **{k: np.asarray(outputs[k], np.float32)})
    for name, update in parts.items():
        window[name] = update if name not in window else window[name].merge(update)
    return window


def compute(window: dict) -> dict[str, float]:
    """The window's values, by metric name."""
    return {k: float(v) for part in window.values() for k, v in part.compute().items()}


# ---------------------------------------------------------------------------- writers


class MetricWriter(abc.ABC):
    """The clu ``MetricWriter`` interface subset the trainer uses (clu's needs TensorFlow)."""

    @abc.abstractmethod
    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    @abc.abstractmethod
    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...

    def flush(self) -> None:  # noqa: B027 - optional hook
        pass

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class EventFileMetricWriter(MetricWriter):
    """TF-free TensorBoard event files through tensorboard's own EventFileWriter.

    Tags are written verbatim (tensorboardX would rewrite ``eval/loss@steps=4``).
    """

    def __init__(self, logdir: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(logdir, flush_secs=10)

    def write_scalars(self, step, scalars):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=int(step),
                                     summary=Summary(value=values)))

    def write_texts(self, step, texts):
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])
        values = [
            Summary.Value(tag=k, metadata=meta, tensor=TensorProto(
                dtype=types_pb2.DT_STRING, string_val=[v.encode()], tensor_shape=shape))
            for k, v in texts.items()
        ]
        self._writer.add_event(Event(wall_time=time.time(), step=int(step),
                                     summary=Summary(value=values)))

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()


class CluWriter(MetricWriter):
    """clu's TensorFlow summary writer, used when TensorFlow is importable."""

    def __init__(self, logdir: str):
        from clu import metric_writers

        self._writer = metric_writers.create_default_writer(logdir, asynchronous=False)

    def write_scalars(self, step, scalars):
        self._writer.write_scalars(int(step), dict(scalars))

    def write_texts(self, step, texts):
        self._writer.write_texts(int(step), dict(texts))

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()


class JsonlWriter(MetricWriter):
    """One JSON line per write: ``RunDir.metrics`` for scripts and tests."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write_scalars(self, step, scalars):
        row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(row) + "\n")

    def write_texts(self, step, texts):
        pass

    def flush(self):
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self):
        self._file.close()


class MultiWriter(MetricWriter):
    def __init__(self, writers: list[MetricWriter]):
        self._writers = writers

    def write_scalars(self, step, scalars):
        for w in self._writers:
            w.write_scalars(step, scalars)

    def write_texts(self, step, texts):
        for w in self._writers:
            w.write_texts(step, texts)

    def flush(self):
        for w in self._writers:
            w.flush()

    def close(self):
        for w in self._writers:
            w.close()


def tensorflow_available() -> bool:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


def create_writer(run: str | RunDir, process_index: int | None = None) -> MetricWriter:
    """TensorBoard + jsonl writer in the run directory on process 0; a no-op elsewhere."""
    if (jax.process_index() if process_index is None else process_index) != 0:
        return MultiWriter([])
    run = run if isinstance(run, RunDir) else RunDir(run)
    tb = CluWriter(run.path) if tensorflow_available() else EventFileMetricWriter(run.path)
    return MultiWriter([tb, JsonlWriter(run.metrics)])


def trim_after(jsonl_path: str, event_paths: list[str], step: int) -> int:
    """Drop what was logged for steps after ``step`` (the checkpoint a run resumes from):
    the jsonl rows and TensorBoard events, each file rewritten atomically, so the
    resumed run's rows are the only ones for those steps. Returns the rows dropped."""
    dropped = 0
    if os.path.exists(jsonl_path):
        with open(jsonl_path) as f:
            lines = f.readlines()
        kept = [line for line in lines if _jsonl_step(line) <= step]
        dropped = len(lines) - len(kept)
        if dropped:
            _replace(jsonl_path, lambda f: f.writelines(kept), "w")
    for path in event_paths:
        _trim_events(path, step)
    return dropped


def logged_keys(jsonl_path: str, step: int) -> set[str]:
    """Every key of the rows logged at ``step`` (a torn line skipped): what the trainer
    asks to learn whether a finished run's final eval ran."""
    keys: set[str] = set()
    if os.path.exists(jsonl_path):
        with open(jsonl_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and row.get("step") == step:
                    keys.update(row)
    return keys


def _jsonl_step(line: str) -> float:
    try:
        return json.loads(line).get("step", -1)
    except (json.JSONDecodeError, AttributeError):
        return math.inf  # a torn last line of a killed run: not part of the timeline


def _trim_events(path: str, step: int) -> None:
    """An event file without the events of steps after ``step`` (records copied verbatim)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    records = list(RawEventFileLoader(path).Load())
    kept = [r for r in records if Event.FromString(r).step <= step]
    if len(kept) == len(records):
        return

    def write(f):
        writer = RecordWriter(f)
        for r in kept:
            writer.write(r)

    _replace(path, write, "wb")


def _replace(path: str, write: Callable[[Any], None], mode: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, mode) as f:
        write(f)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- progress


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def eta(done: int, total: int | None, elapsed: float) -> float:
    """Seconds left at the mean rate so far (NaN before the first item, or without a total)."""
    if total is None or done <= 0:
        return math.nan
    return max(total - done, 0) * elapsed / done


class Progress:
    """The progress line of a long pass that is not training (eval batches, the depth
    report's evaluations, lm-eval requests): ``'eval: 12/40 batches | 3.1/s | ETA 9s'``,
    logged (stderr, ``ode_lm.progress``) at most every ``every_s`` seconds, so a pass shorter
    than that shows nothing; the ETA is ``eta`` and ``format_duration``, like training's."""

    def __init__(self, label: str, total: int | None, *, unit: str = "batches",
                 every_s: float = 10.0, clock: Callable[[], float] = time.perf_counter,
                 log_fn: Callable[[str], None] | None = None, heartbeat: bool = False):
        """``heartbeat``: a thread also logs the line when no item has ended for
        ``every_s`` (a first batch that compiles and solves at a large N for minutes is
        not silent); ``close`` (or ``done``) stops it."""
        import logging
        import threading

        self.label, self.total, self.unit, self.every_s, self.clock = (
            label, total, unit, every_s, clock)
        self.log = log_fn or logging.getLogger("ode_lm.progress").info
        self.start = self._last = clock()
        self.done_items, self.shown = 0, False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if heartbeat:
            threading.Thread(target=self._beat, daemon=True, name="ode_lm-progress").start()

    def line(self, done: int) -> str:
        elapsed = self.clock() - self.start
        of = f"/{self.total}" if self.total is not None else ""
        if done == 0:  # the first item still running (a compile, a long solve)
            return (f"{self.label}: 0{of} {self.unit} | {format_duration(elapsed)} on the "
                    "first (compile + run)")
        rate = f"{done / elapsed:.1f}/s" if elapsed > 0 else "n/a"
        text = f"{self.label}: {done}{of} {self.unit} | {rate}"
        if self.total is not None:
            text += f" | ETA {format_duration(eta(done, self.total, elapsed))}"
        return text

    def update(self, done: int) -> None:
        self.done_items = done
        with self._lock:
            now = self.clock()
            if now - self._last >= self.every_s:
                self._last, self.shown = now, True
                self.log(self.line(done))

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s / 4):
            self.update(self.done_items)

    def close(self) -> None:
        """Stop the heartbeat (a pass that ended, or failed); no line."""
        self._stop.set()

    def done(self) -> None:
        """The closing line, only after a pass that showed one (short passes stay quiet)."""
        self.close()
        if self.shown:
            self.log(self.line(self.done_items))


def progress_line(step: int, total: int, loss: float, tokens_per_s: float, mfu_value: float,
                  eta_s: float) -> str:
    """'step 120/600 | loss 4.213 | 12.3k tok/s | MFU 23.1% | ETA 1m32s'."""
    mfu_text = f"{100 * mfu_value:.1f}%" if math.isfinite(mfu_value) else "n/a"
    tok_text = f"{tokens_per_s / 1e3:.1f}k" if math.isfinite(tokens_per_s) else "n/a"
    return (
        f"step {step}/{total} | loss {loss:.4f} | {tok_text} tok/s | "
        f"MFU {mfu_text} | ETA {format_duration(eta_s)}"
    )


class MetricWindow:
    """The logging window: clu metrics of its steps, plus throughput over the steps timed.

    A step is timed by the interval between two reads of outputs with exactly one step
    dispatched in between: then it is one loop period (completion to completion when
    dispatch is asynchronous, as on accelerators; one inline run when it is not, as on CPU).
    A read with no step dispatched since the previous one (the drain after the loop, a read
    before a checkpoint or an eval) or with several (after such a read) times nothing, nor
    does the first read (its interval holds the compile); ``restart()`` after an eval keeps
    the eval out. Tokens/s, step time and MFU are means over the timed steps; a window with
    none writes none of them rather than a wrong number (a drained last step once showed
    "334.3k tok/s | MFU 755.7%").
    """

    def __init__(self, *, tokens_per_step: int, flops_per_token: float, peak_flops: float,
                 total_steps: int, clock: Callable[[], float] = time.perf_counter):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops, self.total_steps, self.clock = peak_flops, total_steps, clock
        self._metrics: Any = None
        self._last_read: tuple[float, int] | None = None  # (time, steps dispatched then)
        self._timed_steps, self._timed_seconds = 0, 0.0  # this window
        self._run_steps, self._run_seconds = 0, 0.0  # every window so far (for the ETA)

    def add(self, outputs: Mapping[str, Any], *, dispatched: int) -> None:
        """One step's host-side outputs, just read back; ``dispatched``: the number of steps
        dispatched so far (this one and any still in flight)."""
        now = self.clock()
        self._metrics = accumulate(self._metrics, outputs)
        if self._last_read is not None and dispatched - self._last_read[1] == 1:
            self._timed_steps += 1
            self._timed_seconds += now - self._last_read[0]
        self._last_read = (now, dispatched)

    def restart(self) -> None:
        """Time nothing up to the next read (after an eval or other work outside a step)."""
        self._last_read = None

    def log(self, step: int, writer: MetricWriter, extra: dict[str, float] | None = None) -> str:
        """Write the window's scalars (and ``extra``) at ``step``, start a new window; the
        progress line."""
        values = compute(self._metrics)
        scalars = {f"train/{k}": v for k, v in values.items()}
        scalars.update(extra or {})
        scalars["train/tokens_seen"] = step * self.tokens_per_step
        tok_s = mfu_value = float("nan")
        if self._timed_steps and self._timed_seconds > 0:
            step_time = self._timed_seconds / self._timed_steps
            tok_s = self.tokens_per_step / step_time
            # the steps' own count (a term's further solves included), else the configured
            mfu_value = mfu(values.get("flops_per_token", self.flops_per_token), tok_s,
                            self.peak_flops)
            scalars["train/tokens_per_second"] = tok_s
            scalars["train/step_time"] = step_time
            if math.isfinite(mfu_value):
                scalars["train/mfu"] = mfu_value
            self._run_steps += self._timed_steps
            self._run_seconds += self._timed_seconds
        writer.write_scalars(step, scalars)
        left = eta(self._run_steps, self._run_steps + self.total_steps - step, self._run_seconds)
        self._metrics, self._timed_steps, self._timed_seconds = None, 0, 0.0
        return progress_line(step, self.total_steps, values["loss"], tok_s,
                             mfu_value, 0.0 if step >= self.total_steps else left)
