"""Train-step benchmark: DiffEqFormer vs the vanilla parallel-block baseline, variants,
checkpoint and solver cost. Prints a table and a summary of ratios and MFU; ``--json``
writes every figure.

    ode-lm bench --config cpu_small --json bench.json
    ode-lm bench --config gpu_large --platform gpu     # on an accelerator
    ode-lm bench --config tiny --sections=recipe --recipes=depth_robust,my_recipe.gin

It times the trainer's own jitted train step (``ode_lm.training.step.jit_train_step``) on
whatever ``jax.devices()`` gives (all of them on the FSDP axis). Benches compared with each
other run round-robin, one step each in turn, so load on a shared host hits them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import statistics
import sys
from collections.abc import Sequence

from ode_lm import cli
from ode_lm.provenance import provenance

SECTIONS = ("compare", "weight_gen", "remat", "dtype", "solver", "checkpoint", "recipe")
DEFAULT_SECTIONS = SECTIONS[:-1]  # recipe: three more compiles, on request
# section recipe: the training recipes' step cost, each read from configs/recipes/<name>.gin
# (or a recipe file of one's own, --recipes); the first is the baseline of the ratios
RECIPES = ("depth_robust", "default", "anytime", "solver_aware")
RECIPE_MODEL_KNOBS = ("time_scale", "time_max_period", "random_grid_offset")
PLATFORMS = ("auto", "cpu", "gpu", "tpu")

# the memory an extra parameter should cost: params, grads, two Adam moments; float32
BYTES_PER_EXTRA_PARAM = 4 * 4

# section: (row label, ModelConfig field, values; None: every fixed-grid solver, models.config's)
SWEEPS = {
    "weight_gen": ("weight gen {}", "weight_generation", ("in_scan", "precompute")),
    "remat": ("remat {}", "remat", ("none", "dots_saveable", "full")),
    "dtype": ("{}", "dtype", ("float32", "bfloat16")),
    "solver": ("{} N={n}", "solver", None),
}


def parse_args(argv: Sequence[str] | None = None, prog: str = "ode-lm bench"
               ) -> argparse.Namespace:
    p = cli.doc_parser(prog, __doc__)
    p.add_argument("--config", default="cpu_small", help="tiny | cpu_small | gpu_large")
    p.add_argument("--steps", type=int, default=10, help="timed steps per bench (>= 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per bench first (>= 1)")
    p.add_argument("--json", default=None, help="write all figures to this JSON file")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma list of {','.join(SECTIONS)}")
    p.add_argument("--platform", default="auto", help="auto (jax.devices()) | cpu | gpu | tpu")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n peak matmul")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="peak FLOP/s of the whole mesh for 'MFU acc' (default: the trainer's: "
                        "the chip table, or the CPU's probed peak)")
    p.add_argument("--checkpoint-dir", default=None, help="where the timed saves go (a tmp dir)")
    p.add_argument("--checkpoint-rounds", type=int, default=3,
                   help="checkpoint group: rounds of --steps steps per bench, in turn (>= 1)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="recipe section: comma list of recipes to time, the first the baseline "
                        "of the ratios; a name in configs/recipes/ or a path to a .gin file")
    args = p.parse_args(argv)
    _validate(p, args)
    if args.platform != "auto":  # before jax is imported
        os.environ["JAX_PLATFORMS"] = args.platform
    from ode_lm.bench.presets import CONFIGS

    if args.config not in CONFIGS:
        p.error(f"--config={args.config!r}: expected one of {sorted(CONFIGS)}")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        p.error(f"--recipes={args.recipes!r}: expected a comma list of recipes")
    for recipe in recipes:
        if not recipe_path(recipe).is_file():
            p.error(f"--recipes={args.recipes!r}: {recipe!r} is neither a recipe in "
                    f"configs/recipes/ nor a .gin file ({recipe_path(recipe)} not found)")
    args.recipes = recipes
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 1:
        p.error(f"--steps={args.steps}: must be >= 1")
    if args.warmup < 1:
        p.error(f"--warmup={args.warmup}: must be >= 1 (the first call may include set-up)")
    if args.platform not in PLATFORMS:
        p.error(f"--platform={args.platform!r}: expected one of {PLATFORMS}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections={args.sections!r}: unknown {bad}; expected a comma list of "
                f"{SECTIONS}")
    args.sections = sections
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            p.error(f"--json={args.json!r}: is a directory, not a file")
        if not os.path.isdir(parent):
            p.error(f"--json={args.json!r}: directory {parent} does not exist")
    if args.checkpoint_rounds < 1:
        p.error(f"--checkpoint-rounds={args.checkpoint_rounds}: must be >= 1")
    if args.checkpoint_dir and not os.path.isdir(args.checkpoint_dir):
        p.error(f"--checkpoint-dir={args.checkpoint_dir!r} is not a directory")
    if args.peak_flops is not None and args.peak_flops <= 0:
        p.error(f"--peak-flops={args.peak_flops}: must be > 0")
    if args.matmul_size < 64:
        p.error(f"--matmul-size={args.matmul_size}: must be >= 64")


def run_bench(args: argparse.Namespace) -> dict:
    """Build, compile and time every requested bench; print the table; return the figures."""
    import jax

    from ode_lm.bench import train_bench as bu
    from ode_lm.models.config import SOLVERS
    from ode_lm.models.lm import precompute_weights
    from ode_lm.training import checkpoint as ckpt_lib

    cfg = bu.get_config(args.config)
    devices = jax.devices()
    if cfg.batch_size % len(devices):
        raise SystemExit(f"bench: --config={cfg.name} batch {cfg.batch_size} does not split "
                         f"over {len(devices)} devices")
    mesh = bu.make_mesh(devices)
    n = cfg.num_steps
    print(f"config {cfg.name}: d_model {cfg.d_model}, {cfg.num_heads} heads, N={n}, "
          f"seq {cfg.seq_len}, batch {cfg.batch_size}, vocab {cfg.vocab_size}, "
          f"D={cfg.time_embed_dim}, S={cfg.sinusoidal_dim}, {cfg.dtype}")
    print(f"devices: {len(devices)} x {devices[0].platform} ({devices[0].device_kind}); "
          f"load average {_load()}")
    mm_peak = bu.matmul_peak("float32", args.matmul_size)  # (per wall s, per CPU s)
    if args.peak_flops:
        acc_peak, acc_src = args.peak_flops, "--peak-flops"
    else:
        acc_peak, acc_src = bu.accelerator_peak(devices, cfg.dtype)
    print(f"measured fp32 jnp.dot peak ({args.matmul_size}^2): {mm_peak[0] / 1e9:.1f} GFLOP/s "
          f"(wall), {mm_peak[1] / 1e9:.1f} GFLOP per CPU-second; accelerator peak "
          f"{acc_peak / 1e9:.1f} GFLOP/s ({acc_src})")

    base = cfg.model_config("ode")
    cache: dict = {}

    def bench(model_config, label: str):
        if model_config not in cache:
            b = bu.TrainBench(label, cfg, model_config, mesh)
            print(f"  compiled {label:<28} {b.compile_s:7.1f} s, {b.params / 1e6:.2f} M params",
                  flush=True)
            cache[model_config] = b
        return cache[model_config]

    resolved = "precompute" if precompute_weights(base, n, base.solver) else "in_scan"
    ode_label = f"ode {base.solver} N={n} {resolved}"
    ode = bench(base, ode_label)
    plan: list[tuple[str, list[tuple[str, object]], bool]] = []
    if "compare" in args.sections:
        vanilla = bench(cfg.model_config("parallel"), f"vanilla parallel L={n}")
        plan.append(("compare", [(vanilla.label, vanilla), (ode_label, ode)], False))
    # one group per ModelConfig field: each value against the base ODE (the same compile
    # where the value is the base's own)
    current = {**{f: getattr(base, f) for _, f, _ in SWEEPS.values()},
               "weight_generation": resolved}
    for section, (row, field, values) in SWEEPS.items():
        values = SOLVERS if values is None else values
        if section in args.sections:
            plan.append((section, [
                (row.format(v, n=n), ode if v == current[field] else
                 bench(base.replace(**{field: v}), f"ode {field}={v}"))
                for v in values], False))
    if "checkpoint" in args.sections:
        plan.append(("checkpoint", [
            ("no saves", ode),
            ("async save every 10", ode.sibling("ckpt10", 10, args.checkpoint_dir)),
            ("async save every step", ode.sibling("ckpt1", 1, args.checkpoint_dir)),
            ("every step, save on loop", ode.sibling(
                "ckpt1loop", 1, args.checkpoint_dir,
                checkpoint_config=ckpt_lib.CheckpointConfig(off_loop=False))),
            *([("every step into /dev/shm", ode.sibling("ckpt1shm", 1, "/dev/shm"))]
              if os.path.isdir("/dev/shm") else []),
        ], True))

    if "recipe" in args.sections:
        recipes = {name: recipe_configs(name, base) for name in args.recipes}
        plan.append(("recipe", [(name, bu.TrainBench(f"recipe {name}", cfg, model, mesh,
                                                     step_config=step))
                                for name, (model, step) in recipes.items()], False))

    results: dict = {
        "config": dataclasses.asdict(cfg),
        "command": shlex.join(["ode-lm", "bench", *getattr(args, "argv", sys.argv[1:])]),
        "provenance": provenance(["bench", *getattr(args, "argv", sys.argv[1:])]),
        "devices": [str(d) for d in devices],
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "load_average_start": _load(),
        "matmul_peak_flops": mm_peak[0],
        "matmul_peak_flops_per_cpu_s": mm_peak[1],
        "accelerator_peak_flops": acc_peak,
        "accelerator_peak_source": acc_src,
        "steps": args.steps,
        "warmup": args.warmup,
        "groups": {},
    }
    for group, members, use_mean in plan:
        benches = [b for _, b in members]
        if group == "checkpoint":
            times = bu.time_in_blocks(benches, args.steps, args.warmup, args.checkpoint_rounds)
        else:
            times = bu.time_round_robin(benches, args.steps, args.warmup)
        rows = []
        for (label, b), t in zip(members, times, strict=True):
            row = b.summary(t, mm_peak, acc_peak, use_mean=use_mean)
            row["variant"] = label
            if b.checkpointer is not None:
                row["checkpoint_every"] = b.checkpoint_every
                row["saves"] = b.saves
                row.update(_blocked(b.save_blocked_s))
                row["final_save_wait_s"] = b.close()
            rows.append(row)
        for row, t in zip(rows, times, strict=True):
            # Paired: the median over rounds of this bench's step (round-robin) or block
            # (checkpoint group) over the first bench's of the same round, so load that
            # drifts over the run cancels.
            if group == "checkpoint":
                row["relative_step_time"] = bu.paired_block_ratio(t, times[0], args.steps, 0)
                row["relative_cpu_time"] = bu.paired_block_ratio(t, times[0], args.steps, 1)
                row["rounds"] = args.checkpoint_rounds
            else:
                row["relative_step_time"] = bu.paired_ratio(t, times[0], 0)
                row["relative_cpu_time"] = bu.paired_ratio(t, times[0], 1)
            if row.get("save_blocked_ms") is not None:
                row["save_blocked_fraction_of_step"] = (
                    row["save_blocked_ms"] / 1e3 / rows[0]["step_s_median"])
        results["groups"][group] = rows
    # The peak is a best-of: measure again after the timed steps (load on a shared host
    # changes during a run) and keep the higher rate; MFU figures use the final peak.
    again = bu.matmul_peak("float32", args.matmul_size)
    if again[0] > mm_peak[0] or again[1] > mm_peak[1]:
        mm_peak = (max(mm_peak[0], again[0]), max(mm_peak[1], again[1]))
        for rows in results["groups"].values():
            for row in rows:
                row["mfu_vs_matmul_peak"] = row["achieved_flops"] / mm_peak[0]
                row["mfu_cpu_time"] = row["flops_per_step"] / row["cpu_s"] / mm_peak[1]
    results["matmul_peak_flops"], results["matmul_peak_flops_per_cpu_s"] = mm_peak
    print(f"fp32 jnp.dot peak, best of start and end: {mm_peak[0] / 1e9:.1f} GFLOP/s (wall), "
          f"{mm_peak[1] / 1e9:.1f} GFLOP per CPU-second")
    results["memory"] = {
        "compiled_peak": "XLA buffer assignment of the compiled train step: arguments + "
                         "temporaries + outputs - aliased (donated) bytes",
        "process_peak_rss_bytes": bu.process_peak_rss_bytes(),
    }
    results["load_average_end"] = _load()
    results["summary"] = _summary(results["groups"])
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=_json_default)
        print(f"wrote {args.json}")
    return results


def recipe_path(name: str) -> pathlib.Path:
    """A recipe's file: a path ending in .gin as given, else ``configs/recipes/<name>.gin``."""
    from ode_lm.gin_setup import CONFIGS_DIR

    if name.endswith(".gin"):
        return pathlib.Path(name)
    return CONFIGS_DIR / "recipes" / f"{name}.gin"


def recipe_configs(name: str, base):
    """(ModelConfig, StepConfig) of ``base`` trained with the recipe file ``name`` names
    (``recipe_path``): the recipe files own the values, the bench only reads them."""
    from ode_lm import gin_setup

    path = recipe_path(name).resolve()
    gin_setup.parse_gin(gin_setup.parse_flags([f"--gin_file={path}"]))
    try:
        bound = gin_setup.GinModelConfig()  # the recipe's knobs over the defaults
        model = base.replace(**{k: getattr(bound, k) for k in RECIPE_MODEL_KNOBS})
        return model, gin_setup.GinStepConfig()
    finally:
        gin_setup.clear()


def _blocked(blocked_s: list[float]) -> dict:
    """How long the train loop was held per save: median and max (ms) over the saves."""
    if not blocked_s:
        return {"save_blocked_ms": None, "save_blocked_ms_max": None}
    return {"save_blocked_ms": 1e3 * statistics.median(blocked_s),
            "save_blocked_ms_max": 1e3 * max(blocked_s)}


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _json_default(x):
    return float(x) if hasattr(x, "__float__") else str(x)


def _summary(groups: dict) -> dict:
    """The headline figures: ODE vs vanilla (step time, MFU, memory) and what saving costs.
    ``value`` is from wall-clock times; ``value_cpu_time`` the same figure from process CPU
    time (robust to other processes' load on a shared host)."""
    out: dict = {}
    if "compare" in groups:
        vanilla, ode = groups["compare"]
        out["ode_vanilla_step_ratio"] = _figure(
            ode["relative_step_time"], ode["relative_cpu_time"],
            ratio_of_medians=ode["step_s"] / vanilla["step_s"])
        out["ode_mfu_vs_matmul_peak"] = _figure(ode["mfu_vs_matmul_peak"], ode["mfu_cpu_time"])
        if ode["compiled_peak_bytes"] and vanilla["compiled_peak_bytes"]:
            # what the ODE should need: the vanilla step's memory plus the optimizer state
            # of its extra (hypernetwork) parameters
            extra = ode["params"] - vanilla["params"]
            expected = vanilla["compiled_peak_bytes"] + BYTES_PER_EXTRA_PARAM * extra
            out["ode_memory_vs_expected"] = _figure(
                ode["compiled_peak_bytes"] / expected, ode_bytes=ode["compiled_peak_bytes"],
                expected_bytes=expected, extra_params=extra)
    if "checkpoint" in groups:
        rows = {r["variant"]: r for r in groups["checkpoint"]}
        for label, key in (("async save every step", "ckpt_every_step_throughput_kept"),
                           ("async save every 10", "ckpt_every_10_throughput_kept")):
            # paired per round (relative_*: this bench's block over the no-save block)
            out[key] = _figure(1 / rows[label]["relative_step_time"],
                               1 / rows[label]["relative_cpu_time"])
        every = rows["async save every step"]
        if every.get("save_blocked_fraction_of_step") is not None:
            out["ckpt_blocked_fraction_of_step"] = _figure(
                every["save_blocked_fraction_of_step"], blocked_ms=every["save_blocked_ms"])
    return out


def _figure(value: float, value_cpu: float | None = None, **more) -> dict:
    return {"value": value, "value_cpu_time": value_cpu, **more}


def format_table(results: dict) -> str:
    w = max([24, *(len(r["variant"]) for rows in results["groups"].values() for r in rows)])
    head = (f"{'group':<11} {'variant':<{w}} {'step ms':>9} {'tok/s':>8} {'rel':>6} "
            f"{'CPU ms':>8} {'rel':>6} {'MFU mm':>7} {'MFU cpu':>7} {'MFU acc':>7} "
            f"{'compile s':>9} {'peak MiB':>8} {'params M':>8} {'GFLOP/step':>10}")
    lines = ["", head, "-" * len(head)]
    for group, rows in results["groups"].items():
        for r in rows:
            peak = r["compiled_peak_bytes"]
            stat = "*" if r["step_s_statistic"] == "mean" else " "
            lines.append(
                f"{group:<11} {r['variant']:<{w}} {1e3 * r['step_s']:>8.1f}{stat} "
                f"{r['tokens_per_s']:>8.0f} {r['relative_step_time']:>6.3f} "
                f"{1e3 * r['cpu_s']:>8.1f} {r['relative_cpu_time']:>6.3f} "
                f"{100 * r['mfu_vs_matmul_peak']:>6.1f}% {100 * r['mfu_cpu_time']:>6.1f}% "
                f"{100 * r['mfu_vs_accelerator_peak']:>6.1f}% "
                f"{r['compile_s']:>9.1f} {'n/a' if peak is None else f'{peak / 2**20:.1f}':>8} "
                f"{r['params'] / 1e6:>8.2f} {r['flops_per_step'] / 1e9:>10.2f}")
    for r in results["groups"].get("checkpoint", []):
        if r.get("save_blocked_ms") is not None:
            lines.append(
                f"checkpoint  {r['variant']:<{w}} loop blocked {r['save_blocked_ms']:.1f} ms per "
                f"save (median of {r['saves']}, max {r['save_blocked_ms_max']:.1f}): "
                f"{100 * r['save_blocked_fraction_of_step']:.1f}% of a no-save step")
    lines.append("step ms: median wall time of the timed steps (* = mean, so periodic saves "
                 "count); CPU ms: process CPU time per step (all threads; robust to other "
                 "processes' load); rel: vs the first row of the group (round-robin groups: "
                 "median over rounds of the per-round ratio)")
    lines.append("GFLOP/step: model FLOPs of a step as the step counts them (a recipe: each "
                 "compiled variant's, weighted by how often the run draws it)")
    lines.append("MFU: model FLOPs (ode_lm.models.accounting) per second over the peak; mm: vs "
                 "the measured fp32 jnp.dot peak (wall); cpu: both per CPU-second; acc: vs the "
                 "trainer's peak (chip table or the CPU's probed peak; --peak-flops)")
    lines.append("peak MiB: compiled buffer assignment of the step (args + temp + out - "
                 "aliased); process RSS is a high-water mark of the whole run")
    lines.append(f"process peak RSS: {results['memory']['process_peak_rss_bytes'] / 2**20:.0f} "
                 f"MiB; load average start {results['load_average_start']}, end "
                 f"{results['load_average_end']}")
    names = {
        "ode_vanilla_step_ratio": "ODE / vanilla step time",
        "ode_mfu_vs_matmul_peak": "ODE MFU vs measured matmul peak",
        "ode_memory_vs_expected": "ODE peak memory / (vanilla + its extra params)",
        "ckpt_every_step_throughput_kept": "throughput kept, save every step",
        "ckpt_every_10_throughput_kept": "throughput kept, save every 10",
        "ckpt_blocked_fraction_of_step": "loop blocked per save / step",
    }
    lines.append("summary (value by wall time | by CPU time):")
    for key, t in results["summary"].items():
        cpu = "" if t["value_cpu_time"] is None else f" | {t['value_cpu_time']:.3f}"
        lines.append(f"  {names[key]:<44} {t['value']:>8.3f}{cpu}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, prog)
    args.argv = argv  # for the JSON's "command"
    cli.setup_logging()  # also drops gin's "Path not found" noise (section recipe reads gin)

    def body() -> int:
        run_bench(args)
        return 0

    return cli.run_command(prog, body)
