"""Compile the real train step for a TPU topology on this CPU and say whether it fits.

Uses the trainer's own pieces (gin -> mesh -> state spec -> jit'ed train step) with
compile-only TPU devices from libtpu (``pip install -e ".[tpu]"``), then prints per-chip
memory against the chip's HBM, compiled against analytic FLOPs and the expected MFU at a
stated step time. Exit status: 0 fits, 1 does not fit, 2 bad input.

    python tools/aot_compile.py --gin_file=configs/models/tiny.gin \
        --gin_file=configs/data/builtin.gin --topology=v5e:2x2
    python tools/aot_compile.py ... --topology=v5p-128 --num_slices=2 --step_time=1.5
    python tools/aot_compile.py ... --topology=v5e-256 --search --remat=full
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Sequence

from ode_lm import cli

GiB = 1024**3
# Compile-only TPU devices never touch hardware, so several compiles may share libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip facts of a TPU generation (public Cloud TPU specs)."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    cores_in_name: int  # v4-64 / v5p-128 count TensorCores (2 per chip); v5e / v6e chips
    dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
    chip_config_name: str | None = None


CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 2, 3, "megacore"),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2, 3),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 1, 2),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1, 2),
}
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
        raise ValueError(f"--num_slices={num_slices}: must be >= 1")
    known = ", ".join(sorted(CHIPS))
    if m := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", name):
        gen, dims = ALIASES.get(m[1], m[1]), tuple(int(d) for d in m[2].split("x"))
        if gen not in CHIPS:
            raise ValueError(f"--topology={name!r}: unknown TPU generation {m[1]!r} ({known})")
        chip = CHIPS[gen]
        if len(dims) != chip.dims or min(dims) < 1:
            raise ValueError(f"--topology={name!r}: {gen} needs {chip.dims} dimensions, "
                             f"e.g. {gen}:{'x'.join(['2'] * chip.dims)}")
        return Topology(name, f"{gen}:{m[2]}", chip, math.prod(dims), num_slices)
    if m := re.fullmatch(r"([a-z0-9]+)-(\d+)", name):
        gen = ALIASES.get(m[1], m[1])
        if gen not in CHIPS:
            raise ValueError(f"--topology={name!r}: unknown TPU generation {m[1]!r} ({known})")
        chip = CHIPS[gen]
        cores = int(m[2])
        chips = cores // chip.cores_in_name
        shapes = SHAPES_3D if chip.dims == 3 else SHAPES_2D
        if cores % chip.cores_in_name or chips not in shapes:
            sizes = ", ".join(f"{gen}-{c * chip.cores_in_name}" for c in shapes)
            example = f"{gen}:{'x'.join(['2'] * chip.dims)}"
            raise ValueError(f"--topology={name!r}: no standard {gen} slice of that size "
                             f"({sizes}); give a raw shape such as {example}")
        raw = f"{gen}:{'x'.join(str(d) for d in shapes[chips])}"
        return Topology(name, raw, chip, chips, num_slices)
    raise ValueError(f"--topology={name!r}: expected e.g. v5p-128, v5e-256, v4-64, v6e-256 "
                     "or a raw shape such as v5p:4x4x4")


def topology_devices(topo: Topology) -> list:
    """Compile-only TPU devices for the topology (needs libtpu)."""
    from jax.experimental import topologies

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
    from jax._src import cloud_tpu_init

    return cloud_tpu_init.get_tpu_library_path() is not None


# ------------------------------------------------------------------------- compile


@dataclasses.dataclass
class Report:
    topology: Topology
    mesh_shape: dict
    global_batch: int
    seq_len: int
    params_total: int
    params_hypernetwork: int
    fits: bool
    compile_seconds: float
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    peak_bytes: int = 0
    compiled_flops: float = float("nan")  # per chip, from XLA's cost analysis
    analytic_flops_per_token: float = float("nan")
    error: str = ""

    @property
    def per_chip_batch(self) -> float:
        return self.global_batch / self.topology.num_chips

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def mfu(self, step_time: float) -> float:
        peak = self.topology.chip.peak_bf16_flops * self.topology.num_chips
        return self.analytic_flops_per_token * self.tokens_per_step / (step_time * peak)


def load_gin(gin_files: Sequence[str], bindings: Sequence[str]):
    """The run's configs, exactly as ``python -m ode_lm.train`` would parse them."""
    import gin

    from ode_lm.training import gin_setup

    flags = gin_setup.parse_flags([*(f"--gin_file={f}" for f in gin_files), *bindings])
    if flags.rest:
        raise ValueError(f"unknown flag {flags.rest[0]!r}")
    gin_setup.parse_gin(flags)
    gin_setup.check_cli_macros(flags)
    try:
        num_train_steps = int(gin.query_parameter("train.num_train_steps"))
    except (ValueError, TypeError):
        num_train_steps = 1000  # only shapes the LR schedule, which does not change the program
    return dict(model=gin_setup.GinModelConfig(), data=gin_setup.GinDataConfig(),
                optimizer=gin_setup.GinOptimizerConfig(), step=gin_setup.GinStepConfig(),
                mesh=gin_setup.GinMeshConfig(), num_train_steps=num_train_steps)


def count_params(abstract_params) -> tuple[int, int]:
    """(total, hypernetwork): the hypernetwork is the vector field's 'block' subtree."""
    import jax

    total = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
    hyper = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params.get("block", {})))
    return total, hyper


def analytic_flops_per_token(model, num_steps: int | None, seq_len: int) -> float:
    """Training FLOPs per token from ode_lm.models.accounting (NaN if unavailable)."""
    try:
        from ode_lm.models.accounting import flops_per_token
    except ImportError:
        return float("nan")
    return float(flops_per_token(model, num_steps, seq_len=seq_len).training)


def compile_train_step(cfg: dict, topo: Topology, devices: list, global_batch: int) -> Report:
    """Lower + compile the trainer's jit'ed train step on the topology's mesh."""
    import jax

    from ode_lm import partitioning
    from ode_lm.training import state as state_lib
    from ode_lm.training import step as step_lib
    from ode_lm.training import trainer as trainer_lib
    from ode_lm.training.optim import make_optimizer

    model, data, mesh_cfg = cfg["model"], cfg["data"], cfg["mesh"]
    try:
        mesh = partitioning.create_mesh(mesh_cfg.ici_parallelism, mesh_cfg.dcn_parallelism,
                                        devices)
    except ValueError as e:
        raise ValueError(f"MeshConfig does not match --topology={topo.name} ({topo.num_chips} "
                         f"chips in {topo.num_slices} slice(s)): {e}") from None
    rules = partitioning.axis_rules(mesh_cfg.rule_overrides)
    data = dataclasses.replace(data, global_batch_size=global_batch)
    trainer_lib.validate(model, data, cfg["step"], mesh, rules)
    tx, schedule = make_optimizer(cfg["optimizer"], cfg["num_train_steps"])
    spec = state_lib.build_state_spec(trainer_lib.default_model_fn(model), tx, mesh, rules)
    total, hyper = count_params(spec.abstract_params)
    report = Report(topo, dict(mesh.shape), global_batch, data.seq_len, total, hyper,
                    fits=False, compile_seconds=0.0,
                    analytic_flops_per_token=analytic_flops_per_token(
                        model, cfg["step"].num_steps, data.seq_len))
    step_fn = step_lib.jit_train_step(spec, schedule, cfg["step"])
    batch = step_lib.abstract_batch(spec, global_batch, data.seq_len)
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = step_fn.lower(spec.abstract_state, batch).compile()
    except Exception as e:  # XLA reports "does not fit" as a compile error
        if "RESOURCE_EXHAUSTED" not in str(e) and "exceeds" not in str(e):
            raise
        report.compile_seconds = time.perf_counter() - start
        report.error = _first_line(str(e))
        report.temp_bytes = report.peak_bytes = _required_bytes(str(e))
        return report
    report.compile_seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    report.argument_bytes = int(mem.argument_size_in_bytes)
    report.output_bytes = int(mem.output_size_in_bytes)
    report.alias_bytes = int(mem.alias_size_in_bytes)
    report.temp_bytes = int(mem.temp_size_in_bytes)
    live = report.argument_bytes + report.output_bytes - report.alias_bytes + report.temp_bytes
    report.peak_bytes = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or live
    report.peak_bytes = max(report.peak_bytes, live)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report.compiled_flops = float(cost.get("flops", float("nan")))
    report.fits = report.peak_bytes <= topo.chip.hbm_bytes
    return report


def _required_bytes(message: str) -> int:
    """The size XLA says it needed in a RESOURCE_EXHAUSTED message (0 when not stated)."""
    m = re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM", message)
    if not m:
        return 0
    return int(float(m[1]) * 1024 ** "KMGT".index(m[2]) * 1024)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return text[:300]


def search_batch(cfg: dict, topo: Topology, devices: list, shards: int, log=print) -> Report:
    """Largest per-chip batch (a multiple of the batch shards' share) that fits."""

    def attempt(per_chip: int) -> Report:
        r = compile_train_step(cfg, topo, devices, per_chip * topo.num_chips)
        log(f"  per-chip batch {per_chip}: peak {r.peak_bytes / GiB:.2f} GiB -> "
            f"{'fits' if r.fits else 'does not fit'} ({r.compile_seconds:.0f}s)")
        return r

    step = max(1, math.ceil(shards / topo.num_chips))
    best, lo = None, 0
    hi = step
    while True:  # doubling until it does not fit
        r = attempt(hi)
        if not r.fits:
            break
        best, lo, hi = r, hi, hi * 2
    while hi - lo > step:  # bisection on multiples of `step`
        mid = lo + max(step, ((hi - lo) // 2) // step * step)
        r = attempt(mid)
        if r.fits:
            best, lo = r, mid
        else:
            hi = mid
    return best if best is not None else r


# --------------------------------------------------------------------------- output


def describe(r: Report, step_time: float) -> str:
    hbm = r.topology.chip.hbm_bytes
    lines = [
        f"topology     {r.topology.name} ({r.topology.raw}, {r.topology.num_slices} slice(s), "
        f"{r.topology.num_chips} chips, {hbm / GiB:.0f} GiB HBM each)",
        f"mesh         {r.mesh_shape}",
        f"params       {r.params_total:,} total, {r.params_hypernetwork:,} in the hypernetwork",
        f"batch        {r.global_batch} x {r.seq_len} tokens ({r.per_chip_batch:g} sequences "
        f"per chip)",
        f"compile      {r.compile_seconds:.1f} s",
    ]
    if r.error:
        lines.append(f"memory       compile failed: {r.error}")
    else:
        lines += [
            f"memory/chip  arguments {r.argument_bytes / GiB:.3f} GiB | outputs "
            f"{r.output_bytes / GiB:.3f} GiB (aliased {r.alias_bytes / GiB:.3f}) | "
            f"temporaries {r.temp_bytes / GiB:.3f} GiB",
            f"peak/chip    {r.peak_bytes / GiB:.3f} GiB of {hbm / GiB:.0f} GiB HBM "
            f"({100 * r.peak_bytes / hbm:.1f}%)",
        ]
        analytic = r.analytic_flops_per_token * r.tokens_per_step / r.topology.num_chips
        ratio = r.compiled_flops / analytic if analytic > 0 else float("nan")
        lines.append(
            f"FLOPs/chip   compiled {r.compiled_flops:.3e} vs analytic {analytic:.3e} per step "
            f"(ratio {ratio:.2f}; XLA counts a scanned loop body once)")
        if not math.isnan(r.analytic_flops_per_token):
            lines.append(f"MFU          {100 * r.mfu(step_time):.1f}% expected at "
                         f"{step_time:g} s/step ({r.analytic_flops_per_token:.3e} FLOPs/token)")
    lines.append("fits         " + ("yes" if r.fits else "NO"))
    return "\n".join(lines)


def table_row(label: str, r: Report) -> str:
    mesh = "x".join(str(v) for v in r.mesh_shape.values())
    used = f"{r.peak_bytes / GiB:.1f} GiB" if not r.error else (
        f"≥ {r.peak_bytes / GiB:.0f} GiB" if r.peak_bytes else "> HBM")
    return (f"| {label} | {r.params_hypernetwork / 1e9:.3g}B | {r.params_total / 1e9:.3g}B | "
            f"{r.topology.name} | {mesh} | {r.global_batch}x{r.seq_len} | {used} / "
            f"{r.topology.chip.hbm_bytes / GiB:.0f} GiB | {'yes' if r.fits else 'no'} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gin_file", action="append", default=[], required=True)
    p.add_argument("--topology", required=True, help="v5p-128, v5e-256, v4-64, v6e-256, v5p:4x4x4")
    p.add_argument("--num_slices", type=int, default=1)
    p.add_argument("--global_batch", type=int, help="override DataConfig.global_batch_size")
    p.add_argument("--remat", help="override ModelConfig.remat (none | full | dots_saveable)")
    p.add_argument("--step_time", type=float, default=1.0, help="seconds/step for the MFU line")
    p.add_argument("--search", action="store_true", help="find the largest per-chip batch")
    p.add_argument("--table_label", help="also print a README table row with this label")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--gin.")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    try:
        if args.step_time <= 0:
            raise ValueError(f"--step_time={args.step_time}: must be > 0")
        topo = parse_topology(args.topology, args.num_slices)
        if args.remat:
            rest.append(f"--gin.ModelConfig.remat='{args.remat}'")
        cfg = load_gin(args.gin_file, rest)
        devices = topology_devices(topo)
        batch = args.global_batch or cfg["data"].global_batch_size
        if args.search:
            from ode_lm import partitioning

            mesh = partitioning.create_mesh(cfg["mesh"].ici_parallelism,
                                            cfg["mesh"].dcn_parallelism, devices)
            print(f"searching the largest per-chip batch on {topo.name} "
                  f"(remat={cfg['model'].remat})")
            rules = partitioning.axis_rules(cfg["mesh"].rule_overrides)
            report = search_batch(cfg, topo, devices, partitioning.batch_shards(mesh, rules))
        else:
            report = compile_train_step(cfg, topo, devices, batch)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if os.environ.get("ODE_LM_DEBUG"):
            raise
        print(f"aot_compile.py: error: {_first_line(str(e))}", file=sys.stderr)
        return 2
    print(describe(report, args.step_time))
    if args.table_label:
        print(table_row(args.table_label, report))
    if not report.fits:
        need = (f"{report.peak_bytes / GiB:.2f} GiB" if not report.error else
                f"at least {report.peak_bytes / GiB:.1f} GiB" if report.peak_bytes else
                "more than HBM")
        remat = "" if cfg["model"].remat == "full" else ", use --remat=full"
        print(f"aot_compile.py: does not fit: the train step needs {need} per chip on "
              f"{topo.name} ({topo.chip.hbm_bytes / GiB:.0f} GiB HBM); lower the batch{remat} "
              "or add chips", file=sys.stderr)
        return 1
    if args.search:
        print(f"largest per-chip batch that fits: {report.per_chip_batch:g} "
              f"(global batch {report.global_batch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
