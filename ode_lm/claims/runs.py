"""The claims' runs, keyed by their settings: each trained once, then reused.

A ``RunSpec`` is everything that sets a run's result: its gin files (their text and the text
of every file they include), its bindings, its seed, and for a fine-tune the run it starts
from. Its key is a hash of those; its directory ``<work_dir>/runs/<name>-s<seed>-<key>``.
``Runs.get`` returns the run's record from ``<work_dir>/records.json`` when it is there,
and otherwise trains it (``gin_setup.train`` / ``gin_setup.finetune`` in this process): a run
that was interrupted resumes from its last checkpoint (the trainer's exact resume), so a
suite stopped anywhere continues where it stopped. Records hold the final eval, the step,
the parameter count and the training FLOPs (the trainer's own per-step count).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ode_lm.claims.io import read_json, write_json

if TYPE_CHECKING:
    from ode_lm.training.run_dir import RunDir

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")
RECORDS = "records.json"
_INCLUDE = re.compile(r"^\s*include\s+['\"]([^'\"]+)['\"]", re.M)
KINDS = ("train", "finetune")


def config_path(name: str) -> str:
    """A gin file as given, or under configs/."""
    return name if os.path.exists(name) else os.path.join(CONFIGS, name)


def gin_text(path: str) -> str:
    """A gin file's text followed by that of every file it includes (looked up beside it,
    then in configs/): what a run's key covers."""
    path = config_path(path)
    text = open(path).read()
    parts = [text]
    for inc in _INCLUDE.findall(text):
        found = next((p for p in (os.path.join(os.path.dirname(path), inc),
                                  os.path.join(CONFIGS, inc)) if os.path.exists(p)), None)
        parts.append(gin_text(found) if found else inc)
    return "\n".join(parts)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a claim: ``kind`` train (``gin_setup.train``) or finetune (from
    ``pretrained``); ``bindings`` after ``files``, as ``--gin.X=V`` flags would be."""

    name: str
    files: tuple[str, ...]
    bindings: tuple[str, ...] = ()
    seed: int = 0
    kind: str = "train"
    pretrained: RunSpec | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"RunSpec.kind={self.kind!r}: expected one of {KINDS}")
        if (self.kind == "finetune") != (self.pretrained is not None):
            raise ValueError(f"RunSpec {self.name}: a finetune needs a pretrained run, "
                             "a train run has none")

    @property
    def key(self) -> str:
        parts = [self.kind, [gin_text(f) for f in self.files], list(self.bindings), self.seed,
                 self.pretrained.key if self.pretrained else None]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:10]

    def directory(self, work_dir: str) -> str:
        return os.path.join(work_dir, "runs", f"{self.name}-s{self.seed}-{self.key}")


def training_flops(run: RunDir) -> float:
    """Training FLOPs of the run so far: Σ over logged windows of the trainer's
    ``train/flops_per_token`` × the tokens of that window."""
    total, seen = 0.0, 0.0
    if not os.path.exists(run.metrics):
        return 0.0
    with open(run.metrics) as f:
        for line in f:
            row = json.loads(line)
            if "train/flops_per_token" in row and "train/tokens_seen" in row:
                tokens = row["train/tokens_seen"]
                total += row["train/flops_per_token"] * (tokens - seen)
                seen = tokens
    return total


class Runs:
    """The suite's runs under ``work_dir``: ``get(spec)`` → its record, training it if need
    be. ``train_fn(spec, model_dir, bindings)`` does the training (default: in process, from
    gin); ``on_start(spec, model_dir)`` is told before each run that trains."""

    def __init__(self, work_dir: str, train_fn: Callable[..., dict] | None = None,
                 on_start: Callable[[RunSpec, str], None] | None = None):
        self.work_dir = work_dir
        self.path = os.path.join(work_dir, RECORDS)
        self.records: dict[str, Any] = read_json(self.path) or {}
        self.train_fn = train_fn or train_in_process
        self.on_start = on_start or (lambda spec, d: None)
        self.trained: list[str] = []  # keys trained by this process (the rest were reused)

    def get(self, spec: RunSpec) -> dict[str, Any]:
        key = f"{spec.name}-s{spec.seed}-{spec.key}"
        if key in self.records:
            return self.records[key]
        extra: list[str] = []
        if spec.pretrained is not None:
            pre = self.get(spec.pretrained)
            extra.append(f"PRETRAINED_DIR = {pre['model_dir']!r}")
        model_dir = spec.directory(self.work_dir)
        self.on_start(spec, model_dir)
        record = self.train_fn(spec, model_dir, extra)
        record.update(name=spec.name, seed=spec.seed, kind=spec.kind, model_dir=model_dir,
                      files=list(spec.files), bindings=list(spec.bindings) + extra)
        self.records[key] = record
        self.trained.append(key)
        write_json(self.path, self.records)
        return record

    def stat(self, spec: RunSpec, name: str, compute: Callable[[str], Any]) -> Any:
        """A statistic of a run's final model (``compute(model_dir)``), computed once."""
        record = self.get(spec)
        stats = record.setdefault("stats", {})
        if name not in stats:
            stats[name] = compute(record["model_dir"])
            write_json(self.path, self.records)
        return stats[name]


def seed_bindings(seed: int) -> list[str]:
    return [f"TrainConfig.seed = {seed}", f"DataConfig.seed = {seed}"]


def train_in_process(spec: RunSpec, model_dir: str, extra: list[str]) -> dict[str, Any]:
    """Train (or resume) ``spec`` in this process through the gin entries."""
    from ode_lm import gin_setup
    from ode_lm.models.accounting import config_param_count
    from ode_lm.training.run_dir import RunDir

    gin_setup.parse_gin(gin_setup.GinFlags(
        files=[config_path(f) for f in spec.files],
        bindings=[*spec.bindings, *seed_bindings(spec.seed), *extra,
                  f"MODEL_DIR = {model_dir!r}"]))
    if spec.kind == "train":
        result = gin_setup.train()
        info: dict[str, Any] = {}
    else:
        result, info = gin_setup.finetune(print_fn=lambda *_: None)
    gin_setup.clear()
    run = RunDir(model_dir)
    if result.nothing_to_train:  # trained before its record was written: the run's own
        saved = run.summary() if spec.kind == "train" else run.finetune_result()
        if not saved or "eval" not in saved:
            raise RuntimeError(f"{model_dir}: trained, but its final eval was never written; "
                               "delete the directory to train the run again")
        result.eval.update(saved["eval"])
    if result.preempted:
        raise KeyboardInterrupt(f"{spec.name} (seed {spec.seed}) stopped at step "
                                f"{result.step} by {result.stopped_by}; rerun to continue")
    params = config_param_count(run.model_config())
    return {"step": result.step, "eval": dict(result.eval), "params": params,
            "trainable": info.get("trainable"), "training_flops": training_flops(run)}
