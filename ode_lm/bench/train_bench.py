"""Measurement pieces for ``ode-lm bench``: the matmul peak, FLOP counting and a wrapper
that compiles and times the *real* train step (``ode_lm.training.step``); the bench sizes
come from ``ode_lm.bench.presets`` (``configs/models/*.gin``).

Timing on a shared machine is noisy, so benches that are compared with each other are timed
round-robin (one step of each in turn): a load spike then hits every variant alike.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from ode_lm import hardware, partitioning
from ode_lm.bench.presets import CONFIGS, BenchConfig, get_config  # noqa: F401 (re-exported)
from ode_lm.models import ModelConfig, build_model
from ode_lm.models.accounting import flops_per_token, param_count
from ode_lm.training import checkpoint as ckpt_lib
from ode_lm.training import metrics as metrics_lib
from ode_lm.training import state as state_lib
from ode_lm.training import step as step_lib
from ode_lm.training.optim import OptimizerConfig, make_optimizer

# ------------------------------------------------------------------------ peak FLOP/s


def matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 10) -> tuple[float, float]:
    """Best-of-``repeats`` rate of one jitted ``jnp.dot`` of two [n, n] matrices:
    (FLOP per wall second, FLOP per process-CPU second). The second is what a shared host
    cannot distort by time-slicing: other processes' load does not add to our CPU time."""
    dt = jnp.dtype(dtype)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dt)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best, best_cpu = math.inf, math.inf
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    return 2.0 * n**3 / best, 2.0 * n**3 / max(best_cpu, 1e-9)


def accelerator_peak(devices: Sequence[jax.Device], dtype: str) -> tuple[float, str]:
    """The trainer's peak of the mesh (chip table, or the CPU's probed peak) and where it
    came from."""
    peak = metrics_lib.total_peak_flops(list(devices), dtype)
    if devices[0].platform == "cpu":
        processes = len({d.process_index for d in devices})
        return peak, (f"probed CPU peak ({hardware.cpu_peak_cache_path()}) x {processes} "
                      "process(es)")
    return peak, f"{devices[0].device_kind} {dtype} table peak x {len(devices)}"


# ------------------------------------------------------------------------ FLOP counting


def _subjaxprs(value: Any):
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def dot_flops(jaxpr: jex_core.Jaxpr) -> float:
    """Matmul FLOPs (2·M·N·K per ``dot_general``) of a jaxpr, scan bodies × their length,
    the largest branch of a ``cond``; ``while`` bodies count once (unknown trip count)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[i] for i in lhs_contract)
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
            continue
        subs = [dot_flops(j) for v in eqn.params.values() for j in _subjaxprs(v)]
        if not subs:
            continue
        if name == "cond":
            total += max(subs)
        else:
            total += sum(subs) * (eqn.params["length"] if name == "scan" else 1)
    return total


def model_flops_per_step(spec: state_lib.StateSpec, schedule, step_config, batch: dict,
                         variant: tuple | None = None) -> float:
    """Matmul FLOPs of one train step (fwd + bwd) as traced: the real step's jaxpr (of one
    variant of the objective; default: its default variant)."""
    fn = step_lib.make_train_step(spec, schedule, step_config, variant)
    with jax.set_mesh(spec.mesh):
        closed = jax.make_jaxpr(fn)(spec.abstract_state, batch)
    return dot_flops(closed.jaxpr)


# ------------------------------------------------------------------------ memory


def compiled_peak_bytes(compiled: Any) -> int | None:
    """XLA buffer assignment peak: arguments + temporaries + outputs not aliased to inputs."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)


def process_peak_rss_bytes() -> int:
    """High-water resident set size of this process so far (Linux: ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ------------------------------------------------------------------------ the train step


def synthetic_batch(cfg: BenchConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens, one document per row, every target counted."""
    rng = np.random.default_rng(seed)
    b, t = cfg.batch_size, cfg.seq_len
    return {
        "inputs": rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int32),
        "targets": rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int32),
        "segment_ids": np.ones((b, t), np.int32),
        "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
        "loss_mask": np.ones((b, t), np.float32),
    }


def make_mesh(devices: Sequence[jax.Device] | None = None):
    """All given devices on the FSDP axis (one device on a plain host)."""
    return partitioning.create_mesh((1, -1, 1), devices=devices)


def bench_state_spec(model_config: ModelConfig, mesh) -> tuple[state_lib.StateSpec, Any]:
    """(state spec, LR schedule) of the trainer's default AdamW for ``model_config`` on
    ``mesh`` under the default rules: what every bench and tool here times or saves."""
    tx, schedule = make_optimizer(OptimizerConfig(), 1000)
    spec = state_lib.build_state_spec(lambda rngs: build_model(model_config, rngs), tx, mesh,
                                      partitioning.axis_rules())
    return spec, schedule


class TrainBench:
    """One compiled train step of one model, its state and a fixed batch, timed per step.

    ``checkpoint_every``: save the state asynchronously through the trainer's
    ``Checkpointer`` after every k-th step (the save call is inside the timed step).
    """

    def __init__(
        self,
        label: str,
        bench: BenchConfig,
        model_config: ModelConfig,
        mesh,
        *,
        step_config: step_lib.StepConfig | None = None,
        checkpoint_every: int | None = None,
        checkpoint_root: str | None = None,
        seed: int = 0,
        count_flops: bool = True,
    ):
        self.label = label
        self.bench = bench
        self.model_config = model_config
        step_config = step_config or step_lib.StepConfig()
        self.rules = partitioning.axis_rules()
        self.spec, self.schedule = bench_state_spec(model_config, mesh)
        abstract_batch = step_lib.abstract_batch(self.spec, bench.batch_size, bench.seq_len)
        train_step = step_lib.jit_train_step(self.spec, self.schedule, step_config, seed)
        # A recipe whose terms draw compiled variants (a shared-solver step, a distillation
        # step): each is compiled and timed, and a step's figures are their mean weighted
        # by how often the run draws each (over VARIANT_DRAW_STEPS of its steps).
        self.variant_weights = variant_weights(train_step)
        with jax.set_mesh(mesh):
            t0 = time.perf_counter()
            self.programs = {v: train_step.program(v).lower(
                self.spec.abstract_state, abstract_batch).compile()
                for v in self.variant_weights}
            self.compile_s = time.perf_counter() - t0
            self.state = state_lib.init_state(self.spec, seed)
            sharding = partitioning.batch_sharding(mesh, self.rules)
            self.batch = {k: jax.device_put(v, sharding)
                          for k, v in synthetic_batch(bench, seed).items()}
        self.compiled = self.programs[max(self.variant_weights, key=self.variant_weights.get)]
        self.mesh = mesh
        # model FLOPs of one step as the trainer's MFU counts them (models.accounting: matmuls
        # only, causal attention halved, no remat recomputation)
        self.flops = float(flops_per_token(model_config, seq_len=bench.seq_len,
                                           tokens_per_batch=bench.tokens_per_step).training
                           ) * bench.tokens_per_step
        self.traced_flops = math.nan
        if count_flops:
            # Matmul FLOPs as traced (full attention matrices), without remat recomputation.
            flops_spec = self.spec if model_config.remat == "none" else bench_state_spec(
                model_config.replace(remat="none"), mesh)[0]
            self.traced_flops = sum(
                w * model_flops_per_step(flops_spec, self.schedule, step_config,
                                         abstract_batch, v)
                for v, w in self.variant_weights.items())
        # as each variant's steps count them (a random N: the N each step drew)
        self.flops_per_token: dict[tuple, list[float]] = collections.defaultdict(list)
        self.params = param_count(self.spec.abstract_params)["total"]
        peaks = [compiled_peak_bytes(c) for c in self.programs.values()]
        self.peak_bytes = None if None in peaks else max(peaks)
        self.seed = seed
        self._init_run_state(checkpoint_every, checkpoint_root)

    def _init_run_state(self, checkpoint_every: int | None, checkpoint_root: str | None,
                        checkpoint_config: ckpt_lib.CheckpointConfig | None = None,
                        async_directories: bool = True):
        self.steps_done = 0
        self.saves = 0
        self.save_blocked_s: list[float] = []  # time each save() that saved held the loop
        self.last_loss = math.nan
        self.checkpoint_every = checkpoint_every
        self._ckpt_dir = None
        self.checkpointer = None
        if checkpoint_every:
            self._ckpt_dir = tempfile.mkdtemp(prefix=f"bench_{self.label}_", dir=checkpoint_root)
            config = checkpoint_config or ckpt_lib.CheckpointConfig()
            self.checkpointer = ckpt_lib.Checkpointer(self._ckpt_dir, dataclasses.replace(
                config, save_every=checkpoint_every, max_to_keep=2, async_save=True),
                async_directories=async_directories)

    def sibling(self, label: str, checkpoint_every: int | None = None,
                checkpoint_root: str | None = None,
                checkpoint_config: ckpt_lib.CheckpointConfig | None = None,
                async_directories: bool = True) -> TrainBench:
        """The same compiled step with its own fresh state (and checkpoint policy; the
        trainer's ``CheckpointConfig`` unless given, async, keep 2)."""
        other = copy.copy(self)
        other.label = label
        # A copy (not a re-init, which would compile the init again) in fresh buffers.
        other.state = jax.tree.map(lambda x: jax.device_put(x, may_alias=False), self.state)
        other._init_run_state(checkpoint_every, checkpoint_root, checkpoint_config,
                              async_directories)
        return other

    def step(self) -> tuple[float, float]:
        """Run one train step to completion (plus the save call): (wall s, process CPU s).
        With several variants each runs once and the figures are their weighted mean."""
        dt = dc = 0.0
        with jax.set_mesh(self.mesh):
            for variant, weight in self.variant_weights.items():
                t0, c0 = time.perf_counter(), time.process_time()
                self.state, metrics = self.programs[variant](self.state, self.batch)
                jax.block_until_ready((self.state, metrics))
                dt += weight * (time.perf_counter() - t0)
                dc += weight * (time.process_time() - c0)
                self.flops_per_token[variant].append(float(metrics["flops_per_token"]))
            self.steps_done += 1
            if self.checkpointer is not None:
                s0, c0 = time.perf_counter(), time.process_time()
                if self.checkpointer.save(self.steps_done, self.state):
                    self.saves += 1
                    self.save_blocked_s.append(time.perf_counter() - s0)
                dt += time.perf_counter() - s0
                dc += time.process_time() - c0
        self.last_loss = float(metrics["loss"])
        return dt, dc

    @property
    def step_flops(self) -> float:
        """Model FLOPs of a step as the steps count them (each variant's, weighted; a random
        N counts the N it drew), else the accounting at the config's N."""
        if len(self.flops_per_token) < len(self.variant_weights):
            return self.flops
        return self.bench.tokens_per_step * sum(
            w * statistics.fmean(self.flops_per_token[v]) for v, w in self.variant_weights.items())

    def close(self) -> float:
        """Finish pending saves (returns the seconds it waited) and delete the checkpoints."""
        waited = 0.0
        if self.checkpointer is not None:
            t0 = time.perf_counter()
            self.checkpointer.close()
            waited = time.perf_counter() - t0
            shutil.rmtree(self._ckpt_dir, ignore_errors=True)
            self.checkpointer = None
        return waited

    def summary(self, times: Sequence[tuple[float, float]], peak: tuple[float, float],
                accel_peak_flops: float, use_mean: bool = False) -> dict[str, Any]:
        """Figures from ``times`` ((wall s, CPU s) per step): the median, or the mean where
        periodic costs (a save every k steps) must count. ``peak``: ``matmul_peak(...)``."""
        walls = [w for w, _ in times]
        cpus = [c for _, c in times]
        stat = statistics.fmean if use_mean else statistics.median
        med = statistics.median(walls) if walls else math.nan
        mean = statistics.fmean(walls) if walls else math.nan
        step_s = mean if use_mean else med
        cpu_s = stat(cpus) if cpus else math.nan
        tok_s = self.bench.tokens_per_step / step_s
        flops = self.step_flops
        achieved = flops / step_s
        return {
            "label": self.label,
            "architecture": self.model_config.architecture,
            "params": self.params,
            "compile_s": self.compile_s,
            "step_s": step_s,
            "step_s_statistic": "mean" if use_mean else "median",
            "step_s_median": med,
            "step_s_mean": mean,
            "step_s_min": min(walls) if walls else math.nan,
            "steps_timed": len(times),
            "tokens_per_s": tok_s,
            "flops_per_step": flops,
            "flops_source": "the step's own count (ode_lm.models.accounting per variant and "
                            "drawn N) x tokens",
            "variants": {str(v): w for v, w in self.variant_weights.items()},
            "programs": max(len(self.variant_weights), 1),  # compiled step variants
            "traced_matmul_flops_per_step": self.traced_flops,
            "achieved_flops": achieved,
            "cpu_s": cpu_s,
            "mfu_vs_matmul_peak": achieved / peak[0],
            "mfu_cpu_time": flops / cpu_s / peak[1],
            "mfu_vs_accelerator_peak": achieved / accel_peak_flops,
            "compiled_peak_bytes": self.peak_bytes,
            "last_loss": self.last_loss,
        }


VARIANT_DRAW_STEPS = 10_000


def variant_weights(train_step: step_lib.TrainStep) -> dict[tuple, float]:
    """How often a run draws each variant of its objective, over its first
    ``VARIANT_DRAW_STEPS`` steps (the draws are the run's own: seed and step)."""
    counts = collections.Counter(train_step.variant(s) for s in range(VARIANT_DRAW_STEPS))
    return {v: counts[v] / VARIANT_DRAW_STEPS for v in train_step.variants() if counts[v]}


def time_in_blocks(benches: Sequence[TrainBench], steps: int, warmup: int = 2,
                   rounds: int = 1) -> list[list[tuple[float, float]]]:
    """``rounds`` rounds; in each, every bench runs ``steps`` steps in turn and then waits
    for its pending save, whose wall and CPU time are added to its last step (so every save
    is paid for in its own block, and never during another bench's steps). Used for
    checkpointing benches; the blocks of one round make a pair (``paired_block_ratio``)."""
    for b in benches:
        for _ in range(warmup):
            b.step()
        if b.checkpointer is not None:
            b.checkpointer.wait()
    times: list[list[tuple[float, float]]] = [[] for _ in benches]
    for _ in range(rounds):
        for b, t in zip(benches, times, strict=True):
            block = [b.step() for _ in range(steps)]
            if b.checkpointer is not None:
                w0, c0 = time.perf_counter(), time.process_time()
                b.checkpointer.wait()
                wall, cpu = block[-1]
                block[-1] = (wall + time.perf_counter() - w0, cpu + time.process_time() - c0)
            t.extend(block)
    return times


def paired_block_ratio(times: Sequence[tuple[float, ...]],
                       reference: Sequence[tuple[float, ...]], block: int,
                       index: int = 0) -> float:
    """Median over rounds of (this bench's block mean / the reference's block mean of the
    same round): ``time_in_blocks``'s pairs, with the drift of a shared host divided out."""
    def means(ts):
        return [statistics.fmean(x[index] for x in ts[i:i + block])
                for i in range(0, len(ts), block)]

    return statistics.median(a / b for a, b in zip(means(times), means(reference), strict=True))


def paired_ratio(times: Sequence[tuple[float, ...]], reference: Sequence[tuple[float, ...]],
                 index: int = 0) -> float:
    """Median over rounds of times[i][index] / reference[i][index]: the ratio of two
    round-robin benches with the drift of a shared host's speed divided out per round."""
    return statistics.median(a[index] / b[index] for a, b in zip(times, reference, strict=True))


def time_round_robin(benches: Sequence[TrainBench], steps: int,
                     warmup: int = 2) -> list[list[tuple[float, float]]]:
    """``warmup`` untimed steps each, then ``steps`` timed steps each, interleaved:
    (wall s, CPU s) per timed step, one list per bench (in order)."""
    for b in benches:
        for _ in range(warmup):
            b.step()
    times: list[list[tuple[float, float]]] = [[] for _ in benches]
    for _ in range(steps):
        for b, t in zip(benches, times, strict=True):
            t.append(b.step())
    return times
