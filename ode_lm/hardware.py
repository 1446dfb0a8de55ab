"""Per-chip accelerator facts: THE one table of peak FLOP/s, HBM and interconnect bandwidth;
and, for CPUs (which no table can list), a measured peak.

Read by the trainer's MFU (``ode_lm.training.metrics``, through ``chip_spec`` and
``cpu_peak_flops``) and by the TPU AOT report (``ode-lm aot``: memory fit and the roofline
estimate). Public vendor figures: Cloud TPU system-architecture pages (v4, v5e, v5p, v6e) and
NVIDIA data sheets (SXM parts). ICI bandwidth is the chip's total interconnect bandwidth (all
links, both directions, as the vendors quote it); for GPUs it is NVLink.

A CPU's peak is the best rate of a short fp32 ``jnp.dot`` probe per machine (CPU model and
the cores this process may use), cached in ``$ODE_LM_CACHE`` (default ``~/.cache/ode_lm``)
as ``cpu_peak_flops.json``: the highest reading so far, probed again after a week;
``TrainConfig.cpu_peak_flops`` and ``ode-lm bench --peak-flops`` set it instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import tempfile
import time

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Dense peak FLOP/s (bf16 and fp32), HBM capacity and bandwidths of one chip.

    fp32 on GPUs means TF32 tensor cores (JAX's default matmul precision there); TPUs run
    fp32 matmuls through the bf16 MXU passes at default precision.
    """

    peak_bf16_flops: float
    peak_fp32_flops: float
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s per chip

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for matmuls in ``dtype`` ('float32', else bf16)."""
        return self.peak_fp32_flops if dtype == "float32" else self.peak_bf16_flops


# Keys are lower-case substrings of ``jax.Device.device_kind``; the longest match wins
# ('tpu v5 lite' before 'tpu v5').
CHIP_SPECS: dict[str, ChipSpec] = {
    "tpu v4": ChipSpec(275e12, 275e12, 32 * GiB, 1200e9, 300e9),
    "tpu v5 lite": ChipSpec(197e12, 197e12, 16 * GiB, 819e9, 200e9),  # v5e
    "tpu v5e": ChipSpec(197e12, 197e12, 16 * GiB, 819e9, 200e9),
    "tpu v5p": ChipSpec(459e12, 459e12, 95 * GiB, 2765e9, 600e9),
    "tpu v5": ChipSpec(459e12, 459e12, 95 * GiB, 2765e9, 600e9),  # v5p reports 'TPU v5'
    "tpu v6 lite": ChipSpec(918e12, 918e12, 32 * GiB, 1640e9, 448e9),  # v6e (Trillium)
    "tpu v6e": ChipSpec(918e12, 918e12, 32 * GiB, 1640e9, 448e9),
    "a100": ChipSpec(312e12, 156e12, 80 * 10**9, 2039e9, 600e9),  # A100 SXM 80 GB
    "h100": ChipSpec(989e12, 494e12, 80 * 10**9, 3350e9, 900e9),  # H100 SXM
    "h200": ChipSpec(989e12, 494e12, 141 * 10**9, 4800e9, 900e9),
}

# TPU generation names (as in topology names such as v5p-128) -> their CHIP_SPECS entry.
TPU_GENERATIONS = {"v4": "tpu v4", "v5e": "tpu v5e", "v5p": "tpu v5p", "v6e": "tpu v6e"}


def chip_spec(device_kind: str) -> ChipSpec | None:
    """The spec of a ``device_kind`` (e.g. 'TPU v5 lite', 'NVIDIA H200'); None if unknown."""
    kind = device_kind.lower()
    for name in sorted(CHIP_SPECS, key=len, reverse=True):
        if name in kind:
            return CHIP_SPECS[name]
    return None


# ------------------------------------------------------------------------ CPUs: measured

CPU_PROBE_SIZE = 2048  # n of the n x n fp32 matmul: big enough for every core's vector units
CPU_PROBE_REPEATS = 5
CPU_PEAK_MAX_AGE_DAYS = 7  # then probed again: a quieter moment may read higher


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what ``platform`` knows)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return model or platform.processor() or platform.machine() or "unknown cpu"


def cpu_cores() -> int:
    """The cores this process may use (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_key() -> str:
    """What the CPU peak depends on: the CPU model and the cores this process may use."""
    return f"{cpu_model()} x{cpu_cores()}"


def cpu_peak_cache_path() -> str:
    base = os.environ.get("ODE_LM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "ode_lm")
    return os.path.join(base, "cpu_peak_flops.json")


def probe_cpu_peak_flops(n: int = CPU_PROBE_SIZE, repeats: int = CPU_PROBE_REPEATS) -> float:
    """Best rate (FLOP per wall second) of a jitted fp32 [n, n] @ [n, n] on the CPU."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()  # compile
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / max(best, 1e-9)


def _cached_entry(value: object) -> tuple[float, float] | None:
    """(best FLOP/s, time of the last probe) of a cache entry; a bare number (the older
    format) counts as probed long ago, so it is probed again and kept if still the best."""
    if isinstance(value, int | float) and value > 0:
        return float(value), 0.0
    if isinstance(value, dict):
        flops, probed = value.get("flops"), value.get("probed", 0.0)
        if isinstance(flops, int | float) and flops > 0 and isinstance(probed, int | float):
            return float(flops), float(probed)
    return None


@functools.cache
def cpu_peak_flops(cache_path: str | None = None) -> float:
    """This machine's CPU peak FLOP/s: the best probe of ``cpu_key()`` so far, cached. A
    probe taken while other jobs load the CPU reads low, so a new reading never lowers the
    cached one; the cache is probed again (only to raise it) once older than
    ``CPU_PEAK_MAX_AGE_DAYS``. A cache that cannot be written is not an error."""
    path = cache_path or cpu_peak_cache_path()
    key = cpu_key()
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict):
        table = {}
    entry = _cached_entry(table.get(key))
    now = time.time()
    if entry is not None and now - entry[1] < CPU_PEAK_MAX_AGE_DAYS * 86400:
        return entry[0]
    peak = max(probe_cpu_peak_flops(), entry[0] if entry else 0.0)
    table[key] = {"flops": peak, "probed": now}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: processes probing together each write a whole file
    except OSError:
        pass
    return peak
