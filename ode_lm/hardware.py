"""Per-chip accelerator facts: THE one table of peak FLOP/s, HBM and interconnect bandwidth.

Read by the trainer's MFU (``ode_lm.training.metrics``, through ``chip_spec``) and by the
TPU AOT report (``ode-lm aot``: memory fit and the roofline estimate). Public vendor figures:
Cloud TPU system-architecture pages (v4, v5e, v5p, v6e) and NVIDIA data sheets (SXM parts).
ICI bandwidth is the chip's total interconnect bandwidth (all links, both directions, as
the vendors quote it); for GPUs it is NVLink.
"""

from __future__ import annotations

import dataclasses

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
