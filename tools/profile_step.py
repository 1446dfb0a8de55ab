"""Where a train step's time goes: trace the bench's compiled step and rank its XLA ops.

The evidence behind the bench targets (``ode-lm bench``). It builds the same train step
as the bench (``ode_lm.bench.train_bench.TrainBench``), runs ``--steps`` steps under
``jax.profiler``, and sums each XLA op's time per step from the trace, grouped by what the
op belongs to (its ``op_name`` metadata in the compiled HLO):

- ``weight generation``: W(t) = W0 + g(t)·A and its gradient (named scopes in temporal.py);
- ``ODE/layer body fwd|bwd``: the solver's (or the layers') scan body;
- ``head+loss fwd|bwd``: embedding, final norm, vocabulary projection, cross-entropy;
- ``optimizer``: everything outside the differentiated loss: clipping, AdamW, the update;
- ``other``: ops without metadata (scan residual buffers, copies).

Op times are summed over XLA's threads, so the total can exceed the wall time. Needs the
``[profile]`` extra (xprof) to read the trace; without it the raw trace is still written.

    JAX_PLATFORMS=cpu python tools/profile_step.py --config cpu_small --arch ode
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import sys
import tempfile

from ode_lm import cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu_small", help="an ode-lm bench config")
    p.add_argument("--arch", default="ode", help="ode | parallel | sequential")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up)")
    p.add_argument("--top", type=int, default=15, help="ops listed individually")
    p.add_argument("--out", default=None, help="trace directory (default: a tmp dir)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="ModelConfig override, e.g. --set weight_generation=in_scan")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps={args.steps}: must be >= 1")
    return args


def category(op_name: str) -> str:
    """The group of one HLO op from its ``op_name`` metadata."""
    if "weight_generation" in op_name:
        return "weight generation"
    if not op_name:
        return "other"
    backward = "transpose(jvp" in op_name
    if "while/body" in op_name:
        return "ODE/layer body " + ("bwd" if backward else "fwd")
    if "jvp" in op_name:
        return "head+loss " + ("bwd" if backward else "fwd")
    return "optimizer"  # outside the differentiated function: clipping, AdamW, update


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (result shape, op_name metadata) for a compiled HLO module."""
    ops = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+)", line)
        if m and m.group(1) not in ops:
            meta = re.search(r'op_name="([^"]*)"', line)
            ops[m.group(1)] = (m.group(2), meta.group(1) if meta else "")
    return ops


def op_times(trace_events: list[dict]) -> collections.Counter:
    """Total microseconds per XLA op name over the XLA executor threads."""
    threads = {e["tid"]: e["args"]["name"] for e in trace_events
               if e.get("name") == "thread_name" and "args" in e}
    wrappers = ("ThreadpoolListener", "ThunkExecutor", "SlinkyThreadPool", "while")
    times: collections.Counter = collections.Counter()
    for e in trace_events:
        tname = threads.get(e.get("tid"), "")
        if e.get("ph") == "X" and ("XLA" in tname) and not e["name"].startswith(wrappers):
            times[e["name"]] += e["dur"]
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from ode_lm.bench import train_bench as bu

    cfg = bu.get_config(args.config)
    overrides = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"profile_step: --set {item!r}: expected FIELD=VALUE")
        overrides[field] = int(value) if value.isdigit() else value
    model_config = cfg.model_config(args.arch, **overrides)
    bench = bu.TrainBench(args.arch, cfg, model_config, bu.make_mesh(), count_flops=False)
    for _ in range(2):
        bench.step()
    out = args.out or tempfile.mkdtemp(prefix="ode_lm_profile_")
    walls = []
    jax.profiler.start_trace(out)
    for _ in range(args.steps):
        walls.append(bench.step()[0])
    jax.profiler.stop_trace()
    wall_ms = 1e3 * sum(walls) / len(walls)
    print(f"{args.config} {args.arch} {overrides or ''}: {wall_ms:.0f} ms/step wall "
          f"(mean of {args.steps} profiled steps); trace in {out}")
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        print("profile_step: install the [profile] extra (xprof) for the op table")
        return 0
    xspace = sorted(glob.glob(f"{out}/plugins/profile/*/*.xplane.pb"))[-1]
    data, _ = raw_to_tool_data.xspace_to_tool_data([xspace], "trace_viewer", {})
    times = op_times(json.loads(data)["traceEvents"])
    ops = hlo_ops(bench.compiled.as_text())
    groups: collections.Counter = collections.Counter()
    matmul: collections.Counter = collections.Counter()
    for name, us in times.items():
        op_name = ops.get(name, ("", ""))[1]
        groups[category(op_name)] += us
        if op_name.endswith("dot_general") or name.startswith("dot"):
            matmul[category(op_name)] += us
    per_step = lambda us: us / 1e3 / args.steps
    total, total_mm = sum(groups.values()), sum(matmul.values())
    print(f"\n{'group':<22} {'ms/step':>9} {'share':>6} {'matmul ms':>10}")
    for group, us in groups.most_common():
        print(f"{group:<22} {per_step(us):9.1f} {us / total:6.1%} {per_step(matmul[group]):10.1f}")
    print(f"{'sum of op times':<22} {per_step(total):9.1f} {'':6} {per_step(total_mm):10.1f}")
    flops = bench.flops
    print(f"model FLOPs per step {flops / 1e9:.1f} G: {flops / per_step(total_mm) / 1e6:.1f} "
          f"GFLOP/s over the matmul ops' time, {flops / wall_ms / 1e6:.1f} GFLOP/s over the "
          "step's wall time")
    print(f"\ntop {args.top} ops (ms/step, group, result shape, op_name):")
    for name, us in times.most_common(args.top):
        shape, op_name = ops.get(name, ("?", ""))
        short = op_name.replace("jit(train_step)/", "")[:70]
        print(f"{per_step(us):8.1f}  {category(op_name):<18} {shape:<28} {short}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
