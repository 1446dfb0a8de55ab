"""TPU topologies for ahead-of-time compiles on a CPU host: slice names (v5p-128, v5e-256,
raw v5p:4x4x4) -> chip spec and chip count, and libtpu's compile-only devices for them.

The chip facts come from ode_lm.hardware (the one chip table the trainer's MFU reads too).
"""

from __future__ import annotations

import dataclasses
import math
import re

from ode_lm.errors import UsageError
from ode_lm.hardware import CHIP_SPECS, TPU_GENERATIONS, ChipSpec


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation: its spec (ode_lm.hardware, the one chip table) and naming facts."""

    name: str
    spec: ChipSpec
    cores_in_name: int  # v4-64 / v5p-128 count TensorCores (2 per chip); v5e / v6e chips
    dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
    chip_config_name: str | None = None

    @property
    def hbm_bytes(self) -> int:
        return self.spec.hbm_bytes

    @property
    def peak_bf16_flops(self) -> float:
        return self.spec.peak_bf16_flops

    def peak_flops(self, dtype: str) -> float:
        return self.spec.peak_flops(dtype)


def _chip(gen: str, cores_in_name: int, dims: int, config: str | None = None) -> Chip:
    return Chip(gen, CHIP_SPECS[TPU_GENERATIONS[gen]], cores_in_name, dims, config)


CHIPS = {"v4": _chip("v4", 2, 3, "megacore"), "v5p": _chip("v5p", 2, 3),
         "v5e": _chip("v5e", 1, 2), "v6e": _chip("v6e", 1, 2)}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}
# Standard slice shapes by chip count (Cloud TPU docs).
SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
             128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
             2048: (8, 16, 16), 4096: (16, 16, 16)}
SHAPES_2D = {4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
             256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as given
    raw: str  # libtpu form, e.g. v5p:4x4x4
    chip: Chip
    chips_per_slice: int
    num_slices: int = 1

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices


def parse_topology(name: str, num_slices: int = 1) -> Topology:
    """'v5p-128' / 'v5e-256' / 'v4-64' / 'v6e-256' or raw 'v5p:4x4x4' -> Topology."""
    if num_slices < 1:
        raise UsageError(f"--num_slices={num_slices}: must be >= 1")
    known = ", ".join(sorted(CHIPS))
    if m := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", name):
        gen, dims = ALIASES.get(m[1], m[1]), tuple(int(d) for d in m[2].split("x"))
        if gen not in CHIPS:
            raise UsageError(f"--topology={name!r}: unknown TPU generation {m[1]!r} ({known})")
        chip = CHIPS[gen]
        if len(dims) != chip.dims or min(dims) < 1:
            raise UsageError(f"--topology={name!r}: {gen} needs {chip.dims} dimensions, "
                             f"e.g. {gen}:{'x'.join(['2'] * chip.dims)}")
        return Topology(name, f"{gen}:{m[2]}", chip, math.prod(dims), num_slices)
    if m := re.fullmatch(r"([a-z0-9]+)-(\d+)", name):
        gen = ALIASES.get(m[1], m[1])
        if gen not in CHIPS:
            raise UsageError(f"--topology={name!r}: unknown TPU generation {m[1]!r} ({known})")
        chip = CHIPS[gen]
        cores = int(m[2])
        chips = cores // chip.cores_in_name
        shapes = SHAPES_3D if chip.dims == 3 else SHAPES_2D
        if cores % chip.cores_in_name or chips not in shapes:
            sizes = ", ".join(f"{gen}-{c * chip.cores_in_name}" for c in shapes)
            example = f"{gen}:{'x'.join(['2'] * chip.dims)}"
            raise UsageError(f"--topology={name!r}: no standard {gen} slice of that size "
                             f"({sizes}); give a raw shape such as {example}")
        raw = f"{gen}:{'x'.join(str(d) for d in shapes[chips])}"
        return Topology(name, raw, chip, chips, num_slices)
    raise UsageError(f"--topology={name!r}: expected e.g. v5p-128, v5e-256, v4-64, v6e-256 "
                     "or a raw shape such as v5p:4x4x4")


def topology_devices(topo: Topology) -> list:
    """Compile-only TPU devices for the topology (needs libtpu)."""
    from jax.experimental import topologies

    from ode_lm import compat

    cores = topo.chips_per_slice * topo.chip.cores_in_name
    compat.quiet_libtpu_off_tpu(f"{topo.chip.name}-{cores}")
    kwargs = {"num_slices": topo.num_slices} if topo.num_slices > 1 else {}
    if topo.chip.chip_config_name:
        kwargs["chip_config_name"] = topo.chip.chip_config_name
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topo.raw, **kwargs)
    except RuntimeError as e:
        if "not installed" in str(e):
            raise RuntimeError("libtpu is not installed: pip install -e '.[tpu]' "
                               "(the [tpu] extra, about 210 MB)") from None
        raise ValueError(f"--topology={topo.name!r} ({topo.raw}): libtpu rejected it: "
                         f"{str(e).splitlines()[0]}") from None
    devices = list(desc.devices)
    if len(devices) != topo.num_chips:
        raise ValueError(f"--topology={topo.name!r}: libtpu made {len(devices)} devices, "
                         f"expected {topo.num_chips} chips")
    return devices


def libtpu_available() -> bool:
    from ode_lm import compat

    return compat.tpu_library_path() is not None
