"""Compile the real train step for a TPU topology on this CPU and say whether it fits.

Uses the trainer's own pieces (gin -> mesh -> state spec -> jit'ed train step) with
compile-only TPU devices from libtpu (``pip install -e ".[tpu]"``), then prints per-chip
memory against the chip's HBM, compiled against analytic FLOPs and the expected MFU at a
stated step time. Exit status: 0 fits; 1 does not fit, or a bad value/file (one line
``ode-lm aot: error: ...``); 2 a command line that does not parse, or a setting a config
class refuses (``--remat=bogus``). Over 400 lines: the command and its report (memory,
FLOPs, the fit search) are one tool, read together.

    ode-lm aot --gin_file=configs/models/tiny.gin \
        --gin_file=configs/data/builtin.gin --topology=v5e:2x2
    ode-lm aot ... --topology=v5p-128 --num_slices=2 --step_time=1.5
    ode-lm aot ... --topology=v5e-256 --search --remat=full
    ode-lm aot ... --topology=v5p-128 --attention_impl=splash
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Sequence

# Compile-only TPU devices never touch hardware, so several compiles may share libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# libtpu logs to stderr from C++ as it loads (on a CPU host: ``E0000 ... unexpected worker
# hostname``), before any Python logging is set up: errors only, fatal ones, unless the user
# asked for its logs. Set before jax (and so libtpu) is imported.
for _name, _level in (("TPU_STDERR_LOG_LEVEL", "3"), ("TPU_MIN_LOG_LEVEL", "3"),
                      ("TF_CPP_MIN_LOG_LEVEL", "3"), ("GRPC_VERBOSITY", "ERROR")):
    os.environ.setdefault(_name, _level)

from ode_lm import cli  # noqa: E402
from ode_lm.bench.topology import (  # noqa: E402,F401  (re-exported for tests)
    CHIPS,
    Chip,
    Topology,
    libtpu_available,
    parse_topology,
    topology_devices,
)

GiB = 1024**3


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
    label: str = ""  # "" for the configured model, "vanilla" for the baseline
    attention: str = ""  # ModelConfig.attention_impl as resolved for the topology
    comm: dict = dataclasses.field(default_factory=dict)  # the --json layout (report_json)
    comm_lines: list = dataclasses.field(default_factory=list)
    # every variant of the recipe's objective is compiled (a share of RK4 or distillation
    # steps is its own program); the figures are those of the one with the largest peak
    variants: int = 1

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
    """The run's configs, exactly as ``python -m ode_lm.commands.train`` would parse them."""
    from ode_lm import gin_setup

    flags = gin_setup.parse_flags([*(f"--gin_file={f}" for f in gin_files), *bindings])
    if flags.rest:
        raise cli.UsageError(f"unknown flag {flags.rest[0]!r}")
    gin_setup.parse_gin(flags)
    gin_setup.check_cli_macros(flags)
    try:
        num_train_steps = int(gin_setup.query("train.num_train_steps"))
    except (ValueError, TypeError):
        num_train_steps = 1000  # only shapes the LR schedule, which does not change the program
    return dict(model=gin_setup.GinModelConfig(), data=gin_setup.GinDataConfig(),
                optimizer=gin_setup.GinOptimizerConfig(), step=gin_setup.GinStepConfig(),
                mesh=gin_setup.GinMeshConfig(), num_train_steps=num_train_steps)


def vanilla_config(cfg: dict) -> dict:
    """The discrete (sequential) baseline of the same width and depth: one layer per
    vector-field evaluation of the configured ODE (N·stages)."""
    from ode_lm.models.solvers import num_stages

    model, step = cfg["model"], cfg["step"]
    if model.architecture != "ode":
        raise ValueError(f"--vanilla: ModelConfig.architecture={model.architecture!r} is "
                         "already discrete")
    layers = (step.num_steps or model.num_steps) * num_stages(step.solver or model.solver)
    vanilla = dataclasses.replace(model, architecture="sequential", num_layers=layers)
    return {**cfg, "model": vanilla}


def analyze_compiled(report: Report, hlo_text: str, model, abstract_params,
                     num_steps: int | None, solver: str | None) -> None:
    """Fill report.comm / comm_lines: collectives and roofline estimate from the HLO."""
    from ode_lm.bench import hlo_report, step_report
    from ode_lm.models.solvers import num_stages

    cost = hlo_report.analyze(hlo_text)
    ode = model.architecture == "ode"
    evals = ((num_steps or model.num_steps) * num_stages(solver or model.solver) if ode
             else model.num_layers)
    comm = step_report.analytic_min(abstract_params, evaluations=evals,
                                    time_embed_dim=model.time_embed_dim, ode=ode)
    gathers = (step_report.gathered_weights(cost, abstract_params,
                                            time_embed_dim=model.time_embed_dim)
               if ode else None)
    chips = report.topology.num_chips
    analytic = report.analytic_flops_per_token * report.tokens_per_step / chips
    spec = report.topology.chip.spec
    estimate = hlo_report.roofline(
        cost, peak_flops=report.topology.chip.peak_flops(model.dtype),
        hbm_bandwidth=spec.hbm_bandwidth, ici_bandwidth=spec.ici_bandwidth,
        model_flops_per_chip=analytic)
    report.comm = step_report.report_json(cost, comm, estimate, gathers=gathers,
                                          flops_per_chip_analytic=analytic)
    report.comm_lines = step_report.describe_comm(cost, comm, estimate, gathers, analytic,
                                                  report.label)


def compile_train_step(cfg: dict, topo: Topology, devices: list, global_batch: int,
                       label: str = "", comm: bool = True, hlo_path: str | None = None) -> Report:
    """Lower + compile the trainer's jit'ed train step on the topology's mesh; with
    ``comm`` also its communication report and roofline estimate (from the HLO)."""
    import jax

    from ode_lm import partitioning
    from ode_lm.models.accounting import flops_per_token, param_count
    from ode_lm.models.common import attention_impl
    from ode_lm.training import state as state_lib
    from ode_lm.training import step as step_lib
    from ode_lm.training.config import validate
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
    validate(model, data, cfg["step"], mesh, rules)
    tx, schedule = make_optimizer(cfg["optimizer"], cfg["num_train_steps"])
    spec = state_lib.build_state_spec(state_lib.default_model_fn(model), tx, mesh, rules)
    counts = param_count(spec.abstract_params)
    report = Report(topo, dict(mesh.shape), global_batch, data.seq_len, counts["total"],
                    counts["hypernetwork"],
                    fits=False, compile_seconds=0.0, label=label,
                    analytic_flops_per_token=float(flops_per_token(  # the trainer's MFU count
                        model, cfg["step"].num_steps, seq_len=data.seq_len,
                        tokens_per_batch=global_batch * data.seq_len).training))
    step_fn = step_lib.jit_train_step(spec, schedule, cfg["step"])
    batch = step_lib.abstract_batch(spec, global_batch, data.seq_len)
    with jax.set_mesh(mesh):
        report.attention = attention_impl(model, data.seq_len)
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            programs = [step_fn.program(v).lower(spec.abstract_state, batch).compile()
                        for v in step_fn.variants()]
        report.variants = len(programs)
        compiled = max(programs, key=lambda c: _live_bytes(c.memory_analysis()))
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
    text = compiled.as_text() if comm or hlo_path else ""
    if hlo_path:
        try:
            with open(hlo_path, "w") as f:
                f.write(text)
        except OSError as e:
            raise OSError(f"--hlo={hlo_path}: cannot write: {e.strerror}") from None
    if comm:
        analyze_compiled(report, text, model, spec.abstract_params,
                         cfg["step"].num_steps, cfg["step"].solver)
    return report


def _live_bytes(mem) -> int:
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
               + mem.temp_size_in_bytes)


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
        r = compile_train_step(cfg, topo, devices, per_chip * topo.num_chips, comm=False)
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
        f"compile      {r.compile_seconds:.1f} s"
        + (f" ({r.variants} step variants, each compiled)" if r.variants > 1 else ""),
        f"attention    {r.attention}",
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
        lines += r.comm_lines
        if not math.isnan(r.analytic_flops_per_token):
            lines.append(f"MFU          {100 * r.mfu(step_time):.1f}% expected at "
                         f"{step_time:g} s/step ({r.analytic_flops_per_token:.3e} FLOPs/token)")
    lines.append("fits         " + ("yes" if r.fits else "NO"))
    return "\n".join(lines)


def table_row(label: str, r: Report, vanilla: Report | None = None) -> str:
    """A README AOT-table row; with the vanilla baseline, the estimate columns side by side."""
    mesh = "x".join(str(v) for v in r.mesh_shape.values())
    used = f"{r.peak_bytes / GiB:.1f} GiB" if not r.error else (
        f"≥ {r.peak_bytes / GiB:.0f} GiB" if r.peak_bytes else "> HBM")
    row = (f"| {label} | {r.params_hypernetwork / 1e9:.3g}B | {r.params_total / 1e9:.3g}B | "
           f"{r.topology.name} | {mesh} | {r.global_batch}x{r.seq_len} | {used} / "
           f"{r.topology.chip.hbm_bytes / GiB:.0f} GiB | {'yes' if r.fits else 'no'} |")
    if vanilla is None:
        return row

    def est(x: Report) -> tuple[str, str]:
        e = x.comm.get("estimate")
        return (f"{100 * e['mfu']:.0f}%", e["bound"]) if e else ("n/a", "n/a")

    (om, ob), (vm, vb) = est(r), est(vanilla)
    ratio = (r.comm["collective_bytes_per_chip"] / vanilla.comm["collective_bytes_per_chip"]
             if r.comm and vanilla.comm else math.nan)
    return row + f" {om} / {vm} | {ob} / {vb} | {ratio:.2f} |"


def write_json(path: str, reports: list[Report]) -> None:
    """--json: the first report's layout at the top level, the baseline under 'vanilla'."""
    import json

    def one(r: Report) -> dict:
        return {"label": r.label or "model", "topology": r.topology.name,
                "mesh": r.mesh_shape, "global_batch": r.global_batch, "seq_len": r.seq_len,
                "fits": r.fits, "peak_bytes_per_chip": r.peak_bytes, **r.comm}

    out = one(reports[0])
    if len(reports) > 1:
        out["vanilla"] = one(reports[1])
        base = reports[1].comm.get("collective_bytes_per_chip") or math.nan
        out["collective_bytes_ratio_vs_vanilla"] = out.get("collective_bytes_per_chip",
                                                           math.nan) / base
    try:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    except OSError as e:
        raise OSError(f"--json={path}: cannot write: {e.strerror}") from None


def build_parser(prog: str = "ode-lm aot") -> argparse.ArgumentParser:
    p = cli.doc_parser(prog, __doc__)
    p.add_argument("--gin_file", action="append", default=[], required=True)
    p.add_argument("--gin.NAME=VALUE", dest="gin_shorthand", action="store_true",
                   help="gin bindings, as ode-lm train takes them")
    p.add_argument("--topology", required=True, help="v5p-128, v5e-256, v4-64, v6e-256, v5p:4x4x4")
    p.add_argument("--num_slices", type=int, default=1)
    p.add_argument("--global_batch", type=int, help="override DataConfig.global_batch_size")
    p.add_argument("--remat", help="override ModelConfig.remat (none | full | dots_saveable)")
    p.add_argument("--attention_impl",
                   help="override ModelConfig.attention_impl (auto | xla | splash | cudnn)")
    p.add_argument("--step_time", type=float, default=1.0, help="seconds/step for the MFU line")
    p.add_argument("--search", action="store_true", help="find the largest per-chip batch")
    p.add_argument("--table_label", help="also print a README table row with this label")
    p.add_argument("--vanilla", action="store_true",
                   help="also compile the discrete baseline of the same width and depth")
    p.add_argument("--json", help="write the communication report and estimate to this file")
    p.add_argument("--hlo", help="write the compiled (post-optimisation) HLO text to this file")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm aot") -> int:
    cli.setup_logging()  # warnings only; gin's "Path not found" search noise dropped
    p = build_parser(prog)
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--gin.")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    return cli.run_command(prog, lambda: run(args, rest, prog))


def run(args: argparse.Namespace, rest: list[str], prog: str = "ode-lm aot") -> int:
    if args.step_time <= 0:
        raise cli.UsageError(f"--step_time={args.step_time}: must be > 0")
    for flag in ("json", "hlo"):
        path = getattr(args, flag)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"--{flag}={path}: no such directory")
    topo = parse_topology(args.topology, args.num_slices)
    if args.remat:
        rest.append(f"--gin.ModelConfig.remat='{args.remat}'")
    if args.attention_impl:
        rest.append(f"--gin.ModelConfig.attention_impl='{args.attention_impl}'")
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
        report = compile_train_step(cfg, topo, devices, batch, hlo_path=args.hlo)
    reports = [report]
    if args.vanilla and not args.search:
        reports.append(compile_train_step(vanilla_config(cfg), topo, devices,
                                          report.global_batch, label="vanilla"))
    if args.json:
        write_json(args.json, reports)
    print(describe(report, args.step_time))
    if len(reports) > 1:
        v = reports[1]
        print(f"vanilla      sequential baseline, {v.params_total:,} params, "
              f"{cfg['model'].d_model} wide, {vanilla_config(cfg)['model'].num_layers} layers")
        print("\n".join(v.comm_lines))
        if report.comm and v.comm:
            ob, vb = (x.comm["collective_bytes_per_chip"] for x in (report, v))
            ot, vt = (x.comm["estimate"]["step_s"] for x in (report, v))
            print(f"ode/vanilla  collective bytes x{ob / vb:.2f}, estimated step x{ot / vt:.2f}")
    if args.table_label:
        print(table_row(args.table_label, report, reports[1] if len(reports) > 1 else None))
    if not report.fits:
        need = (f"{report.peak_bytes / GiB:.2f} GiB" if not report.error else
                f"at least {report.peak_bytes / GiB:.1f} GiB" if report.peak_bytes else
                "more than HBM")
        remat = "" if cfg["model"].remat == "full" else ", use --remat=full"
        print(f"{prog}: does not fit: the train step needs {need} per chip on "
              f"{topo.name} ({topo.chip.hbm_bytes / GiB:.0f} GiB HBM); lower the batch{remat} "
              "or add chips", file=sys.stderr)
        return cli.EXIT_FAILURE
    if args.search:
        print(f"largest per-chip batch that fits: {report.per_chip_batch:g} "
              f"(global batch {report.global_batch})")
    return 0
