"""AOT-compile the train step of every paper run (configs/runs/paper/) and check it fits.

Each run is meant for a v5p-128 slice (64 chips, pure FSDP: ``MeshConfig.ici_parallelism =
(1, -1, 1)``), at the batch of its gin file. With ``--small`` each run is compiled instead on
a v5p-8 slice (4 chips) at the same per-chip batch (global batch / 16). That is a stricter
memory check, not a looser one: activations per chip are the same, and the parameters and
optimizer state are split 4 ways instead of 64, so a run that fits there fits on v5p-128.
Exit status: 0 every run fits; 1 one does not, or a bad value/file; 2 a command line that
does not parse (the rule of every ode-lm command). The one-run command is ``ode-lm aot``.

    python tools/aot_paper_runs.py --small                 # all 14 runs, the README table
    python tools/aot_paper_runs.py --small owt_small owt_llama_1b
"""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Sequence

from ode_lm import cli
from ode_lm.commands import aot as aot_compile  # sets ALLOW_MULTIPLE_LIBTPU_LOAD first

PAPER = pathlib.Path(__file__).resolve().parents[1] / "configs" / "runs" / "paper"
NOT_RUNS = ("common", "vanilla")  # included by the run files, not runs themselves
TOPOLOGY = "v5p-128"
SMALL = "v5p-8"


def paper_runs() -> list[str]:
    """Every run file of configs/runs/paper/, ODE runs and their vanilla baselines."""
    return sorted(p.stem for p in PAPER.glob("*.gin") if p.stem not in NOT_RUNS)


def compile_run(run: str, topology: str, small: str | None) -> tuple[dict, aot_compile.Report]:
    """The train step of ``run`` on ``topology``, or on ``small`` at the same per-chip batch."""
    from ode_lm import gin_setup

    if run not in paper_runs():
        raise ValueError(f"{run!r}: not a paper run ({', '.join(paper_runs())})")
    try:
        cfg = aot_compile.load_gin([f"runs/paper/{run}.gin"], [])
    finally:
        gin_setup.clear()
    intended = aot_compile.parse_topology(topology)
    batch = cfg["data"].global_batch_size
    if batch % intended.num_chips:
        raise ValueError(f"{run}: batch {batch} does not split over {intended.num_chips} chips")
    per_chip = batch // intended.num_chips
    topo = aot_compile.parse_topology(small) if small else intended
    report = aot_compile.compile_train_step(cfg, topo, aot_compile.topology_devices(topo),
                                            per_chip * topo.num_chips, comm=False)
    return cfg, report


def row(run: str, cfg: dict, r: aot_compile.Report, topology: str) -> str:
    hbm = r.topology.chip.hbm_bytes / aot_compile.GiB
    model = cfg["model"]
    depth = model.num_steps if model.architecture == "ode" else model.num_layers
    kind = f"{'ODE' if model.architecture == 'ode' else 'vanilla'} {model.flavour} " \
           f"{model.d_model}, {'N' if model.architecture == 'ode' else 'L'}={depth}"
    return (f"| `{run}` | {kind} | {topology} | {r.topology.name} | "
            f"{r.global_batch}x{r.seq_len} ({r.per_chip_batch:g}/chip) | "
            f"{r.peak_bytes / aot_compile.GiB:.1f} / {hbm:.0f} GiB | "
            f"{'yes' if r.fits else 'NO'} | {r.compile_seconds:.0f} s |")


def main(argv: Sequence[str] | None = None) -> int:
    cli.setup_logging()
    p = cli.ArgumentParser(prog="aot_paper_runs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="run names (default: every paper run)")
    p.add_argument("--topology", default=TOPOLOGY, help="the runs' intended slice")
    p.add_argument("--small", action="store_true",
                   help=f"compile on {SMALL} at the intended per-chip batch")
    args = p.parse_args(argv)
    unknown = [r for r in args.runs if r not in paper_runs()]
    if unknown:
        p.error(f"{unknown[0]!r}: not a paper run ({', '.join(paper_runs())})")
    print("| run | model | intended | compiled on | batch (per chip) | peak HBM / chip | fits "
          "| compile |\n| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    fits = True
    start = time.perf_counter()
    try:
        for run in args.runs or paper_runs():
            cfg, report = compile_run(run, args.topology, SMALL if args.small else None)
            print(row(run, cfg, report, args.topology), flush=True)
            fits &= report.fits
    except cli.user_errors() as e:
        return cli.report_error("aot_paper_runs.py", e)
    print(f"total {time.perf_counter() - start:.0f} s; "
          f"{'every run fits' if fits else 'a run does not fit'}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
