"""``ode-lm reproduce``: which of the paper's findings hold in a model ode-lm trains.

  ode-lm reproduce [--corpus=data/fortunes.gin] [--scale=claims/tiny.gin] [--seeds=0,1,2]
                   [--claims=ID,PREFIX*,...] [--work_dir=/tmp/ode_lm/claims/builtin]
                   [--json=FILE] [--list] [--gin.NAME=VALUE ...]

Each claim (``ode_lm/claims/suite.py``) is the paper's statement, one statistic per seed and
a threshold fixed in code before the runs; its verdict is ``holds`` (every seed on the claimed
side), ``does not hold`` (none) or ``inconclusive`` (the seeds straddle the threshold). The
runs it needs (the demo's ODE under three recipes, two discrete baselines at equal tokens and
at equal FLOPs, fine-tunes at new depths) are trained on first need under ``--work_dir``,
each in a directory named by its settings, and reused by any later claim or rerun: an
interrupted suite continues where it stopped (Ctrl-C saves the run in progress).
Writes ``<work_dir>/claims.json`` (and ``--json``), and prints one verdict line per claim.
``--gin.NAME=VALUE`` is bound in every run (after the corpus and scale files): a setting
that changes the runs changes their keys.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

from ode_lm import cli
from ode_lm.errors import UsageError

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = "/tmp/ode_lm/claims"


def build_parser(prog: str = "ode-lm reproduce") -> argparse.ArgumentParser:
    p = cli.doc_parser(prog, __doc__)
    p.add_argument("--corpus", default=None,
                   help="a data gin file replacing the built-in corpus (data/fortunes.gin)")
    p.add_argument("--scale", default="claims/tiny.gin",
                   help="the gin file that sets the runs' length (included last)")
    p.add_argument("--seeds", type=cli.int_list, default=[0, 1, 2])
    p.add_argument("--claims", default=None, help="claim ids or prefixes ending in *")
    p.add_argument("--work_dir", default=None,
                   help=f"where runs and claims.json live (default {ROOT}/<corpus>)")
    p.add_argument("--json", default=None, help="also write claims.json here")
    p.add_argument("--list", action="store_true", help="list the claims and stop")
    return p


def split_gin_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the command's own flags, the ``--gin.NAME=VALUE`` bindings as gin lines)."""
    own, bindings = [], []
    for a in argv:
        if a.startswith("--gin."):
            name, sep, value = a[len("--gin."):].partition("=")
            if not sep or not name:
                raise UsageError(f"{a}: expected --gin.NAME=VALUE")
            bindings.append(f"{name} = {value}")
        else:
            own.append(a)
    return own, bindings


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before any run starts (exit 2, naming the flag)."""
    from ode_lm.claims.runs import config_path
    from ode_lm.claims.suite import select

    for flag in ("corpus", "scale"):
        value = getattr(args, flag)
        if value is not None and not os.path.isfile(config_path(value)):
            raise UsageError(f"--{flag}={value}: no such gin file (here or under configs/)")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise UsageError(f"--seeds={','.join(map(str, args.seeds))}: distinct seeds >= 0")
    try:
        args.chosen = select(args.claims.split(",") if args.claims else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for path, flag in ((args.work_dir, "work_dir"), (args.json, "json")):
        if path and os.path.isdir(path) if flag == "json" else (
                path and os.path.exists(path) and not os.path.isdir(path)):
            raise UsageError(f"--{flag}={path}: " + ("a directory" if flag == "json"
                                                     else "not a directory"))


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm reproduce") -> int:
    import sys

    raw = list(sys.argv[1:] if argv is None else argv)

    def go() -> int:
        own, bindings = split_gin_flags(raw)
        args = build_parser(prog).parse_args(own)
        return run(args, bindings)

    cli.setup_logging()
    return cli.run_command(prog, go)


def run(args: argparse.Namespace, bindings: list[str]) -> int:
    check_args(args)
    if args.list:
        for c in args.chosen:
            print(f"{c.id}: {c.statistic} ({c.threshold})")
        return 0
    from ode_lm.claims.figures import finetune_figure, spectra_figure
    from ode_lm.claims.io import write_json
    from ode_lm.claims.report import evaluate, verdict_line, write_page
    from ode_lm.claims.runs import Runs, RunSpec
    from ode_lm.claims.suite import Context
    from ode_lm.provenance import provenance

    corpus = "builtin" if args.corpus is None else os.path.splitext(
        os.path.basename(args.corpus))[0]
    work_dir = args.work_dir or os.path.join(ROOT, corpus)
    t0 = time.time()

    def started(spec: RunSpec, model_dir: str) -> None:
        print(f"[{time.time() - t0:6.0f}s] training {spec.name} (seed {spec.seed}) -> "
              f"{model_dir}", flush=True)

    runs = Runs(work_dir, on_start=started)
    scale = (args.scale,)
    ctx = Context(runs, data_files=(args.corpus,) if args.corpus else (), scale_files=scale)
    if bindings:  # every run's settings, after the corpus and scale files
        ctx = _with_bindings(ctx, bindings)
    rows = evaluate(args.chosen, ctx, args.seeds, on_verdict=lambda r: print(verdict_line(r),
                                                                            flush=True))
    data = {"corpus": corpus, "corpus_file": args.corpus, "scale": args.scale,
            "seeds": args.seeds, "bindings": bindings, "work_dir": work_dir,
            "runs_trained": len(runs.trained), "provenance": provenance(), "claims": rows}
    out = os.path.join(work_dir, "claims.json")
    write_json(out, data)
    if args.json:
        write_json(args.json, data)
    figures = [f for f in (
        spectra_figure(runs.records, os.path.join(work_dir, f"claims_spectra_{corpus}.png")),
        finetune_figure(data, os.path.join(work_dir, f"claims_finetune_{corpus}.png"))) if f]
    page = write_page(data, os.path.join(work_dir, "claims.md"), figures)
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(f"{len(rows)} claims on {corpus}, seeds {args.seeds}: "
          + ", ".join(f"{n} {v}" for v, n in counts.items())
          + f" ({len(runs.trained)} runs trained, {time.time() - t0:.0f}s) -> {out}, {page}")
    return 0


def _with_bindings(ctx, bindings: list[str]):
    """The context whose every run also binds ``bindings`` (a gin file of them, so the run's
    key covers their text)."""
    import hashlib

    from ode_lm.claims.suite import Context

    text = "\n".join(bindings) + "\n"
    name = hashlib.sha256(text.encode()).hexdigest()[:8]
    path = os.path.join(ctx.runs.work_dir, "bindings", f"{name}.gin")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return Context(ctx.runs, ctx.data_files, (*ctx.scale_files, path))


if __name__ == "__main__":
    cli.main_exit(main)
