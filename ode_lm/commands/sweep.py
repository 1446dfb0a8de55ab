"""Expand a scaling sweep (width x ODE steps x time-embed dim) into one training run per point.

A sweep file (``configs/sweeps/*.gin``) holds ``Sweep.*`` bindings with literal values:

    Sweep.name = 'tiny'
    Sweep.gin_files = ['configs/runs/tiny.gin']
    Sweep.widths = [64, 128]
    Sweep.num_steps = [2, 4, 8]
    Sweep.time_embed_dims = [20]
    Sweep.head_dim = 32                       # optional: num_heads = width // head_dim
    Sweep.bindings = {'train.num_train_steps': 200}

Each point becomes gin bindings plus a model dir ``ROOT/<name>-w<W>-n<N>-d<D>``. The runs
are listed (default), trained here one after another (``--run``), or printed as
``launch/tpu_vm.sh`` commands (``--launch_tpu NAME --zone Z``).

    ode-lm sweep configs/sweeps/tiny.gin --root /tmp/sweep [--run | --launch_tpu T ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ode_lm import cli

REPO = pathlib.Path(__file__).resolve().parents[2]  # the checkout: configs/, launch/

# The gin parameters each grid axis sets; a sweep file may rename them (Sweep.*_param).
DEFAULT_PARAMS = {
    "width_param": "ModelConfig.d_model",
    "steps_param": "ModelConfig.num_steps",
    "time_embed_param": "ModelConfig.time_embed_dim",
    "heads_param": "ModelConfig.num_heads",
    "model_dir_param": "train.model_dir",
}


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    name: str
    gin_files: tuple[str, ...]
    widths: tuple[int, ...]
    num_steps: tuple[int, ...]
    time_embed_dims: tuple[int | None, ...] = (None,)  # None: keep the config's value
    head_dim: int | None = None
    bindings: tuple[tuple[str, Any], ...] = ()
    width_param: str = DEFAULT_PARAMS["width_param"]
    steps_param: str = DEFAULT_PARAMS["steps_param"]
    time_embed_param: str = DEFAULT_PARAMS["time_embed_param"]
    heads_param: str = DEFAULT_PARAMS["heads_param"]
    model_dir_param: str = DEFAULT_PARAMS["model_dir_param"]


@dataclasses.dataclass(frozen=True)
class Run:
    """One grid point: what to train and where its model dir is."""

    name: str
    width: int
    num_steps: int
    time_embed_dim: int | None
    model_dir: str
    gin_files: tuple[str, ...]
    bindings: tuple[tuple[str, Any], ...]

    def gin_flags(self) -> list[str]:
        """Flags for ``python -m ode_lm.commands.train`` (and launch/tpu_vm.sh, which passes
        them on)."""
        flags = [f"--gin_file={f}" for f in self.gin_files]
        flags += [f"--gin.{k}={gin_literal(v)}" for k, v in self.bindings]
        return flags


def gin_literal(value: Any) -> str:
    """A value as ``--gin.NAME=VALUE`` text: gin literals are Python literals, and the
    trainer's flag parser takes a bare word (a path, a policy name) as a string."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_/.][A-Za-z0-9_./:@+-]*", value):
        if value not in ("True", "False", "None"):
            return value
    return repr(tuple(value) if isinstance(value, list) else value)


SWEEP_FIELDS = {f.name for f in dataclasses.fields(SweepSpec)}


def parse_sweep(path: str | os.PathLike, overrides: Sequence[str] = ()) -> SweepSpec:
    """Read ``Sweep.*`` bindings from a sweep file, then ``Sweep.x=y`` overrides."""
    from ode_lm.gin_setup import literal_statements

    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"sweep file {path!r} not found")
    values: dict[str, Any] = {}
    sources = [(path, open(path).read())]
    sources += [(f"override {o!r}", o.removeprefix("--gin.")) for o in overrides]
    for where, text in sources:
        for stmt in literal_statements(text, where):
            if stmt is None or stmt[0] != "Sweep":
                raise ValueError(f"{where}: only 'Sweep.<field> = <value>' lines are allowed")
            _, field, value = stmt
            if field not in SWEEP_FIELDS:
                raise ValueError(
                    f"{where}: unknown field Sweep.{field}; "
                    f"expected one of {sorted(SWEEP_FIELDS)}"
                )
            values[field] = value
    for required in ("name", "gin_files", "widths", "num_steps"):
        if required not in values:
            raise ValueError(f"{path}: Sweep.{required} is required")
    return _validated(path, values)


def _int_tuple(path: str, field: str, value: Any, allow_none: bool = False) -> tuple:
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    ok = all((v is None and allow_none) or (isinstance(v, int) and v > 0) for v in items)
    if not items or not ok:
        raise ValueError(f"{path}: Sweep.{field}={value!r} must be a non-empty list of ints > 0")
    return items


def _validated(path: str, v: dict[str, Any]) -> SweepSpec:
    gin_files = tuple(v["gin_files"]) if isinstance(v["gin_files"], (list, tuple)) else (
        v["gin_files"],)
    for f in gin_files:
        if not (REPO / f).is_file() and not os.path.isfile(f):
            raise ValueError(f"{path}: Sweep.gin_files entry {f!r} not found")
    bindings = v.get("bindings", {})
    if not isinstance(bindings, dict):
        raise ValueError(f"{path}: Sweep.bindings must be a dict of 'Configurable.param': value")
    spec = SweepSpec(
        name=str(v["name"]),
        gin_files=gin_files,
        widths=_int_tuple(path, "widths", v["widths"]),
        num_steps=_int_tuple(path, "num_steps", v["num_steps"]),
        time_embed_dims=_int_tuple(path, "time_embed_dims", v.get("time_embed_dims", [None]),
                                   allow_none=True),
        head_dim=v.get("head_dim"),
        bindings=tuple(sorted(bindings.items())),
        **{k: v[k] for k in DEFAULT_PARAMS if k in v},
    )
    if spec.head_dim is not None:
        bad = [w for w in spec.widths if w % spec.head_dim]
        if bad:
            raise ValueError(f"{path}: Sweep.widths {bad} are not multiples of head_dim="
                             f"{spec.head_dim}")
    return spec


def expand(spec: SweepSpec, root: str) -> list[Run]:
    """One Run per (width, ODE steps, time-embed dim), in grid order."""
    runs = []
    for width, steps, dim in itertools.product(spec.widths, spec.num_steps, spec.time_embed_dims):
        name = f"{spec.name}-w{width}-n{steps}" + (f"-d{dim}" if dim is not None else "")
        model_dir = os.path.join(root, name)
        bindings = dict(spec.bindings)
        bindings[spec.width_param] = width
        bindings[spec.steps_param] = steps
        if dim is not None:
            bindings[spec.time_embed_param] = dim
        if spec.head_dim is not None:
            bindings[spec.heads_param] = width // spec.head_dim
        bindings[spec.model_dir_param] = model_dir
        runs.append(Run(name, width, steps, dim, model_dir, spec.gin_files,
                        tuple(bindings.items())))
    return runs


def write_manifest(spec: SweepSpec, runs: list[Run], root: str) -> str:
    """``ROOT/sweep.json``: the grid, for the report and for humans."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "sweep.json")
    with open(path, "w") as f:
        json.dump({"sweep": dataclasses.asdict(spec),
                   "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=2, default=str)
    return path


def train_argv(run: Run) -> list[str]:
    return [sys.executable, "-m", "ode_lm.commands.train", *run.gin_flags()]


def launch_command(run: Run, tpu: str, zone: str, project: str | None = None,
                   extra: Sequence[str] = ()) -> str:
    argv = ["launch/tpu_vm.sh", "--tpu", tpu, "--zone", zone]
    if project:
        argv += ["--project", project]
    argv += run.gin_flags()
    argv += list(extra)
    return shlex.join(argv)


def run_locally(runs: list[Run], log_dir: str) -> list[tuple[Run, int, float]]:
    """Train each run in turn (each resumes if its model dir has a checkpoint)."""
    results = []
    for i, run in enumerate(runs, 1):
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"{run.name}.log")
        print(f"[{i}/{len(runs)}] {run.name} -> {log_path}", flush=True)
        start = time.perf_counter()
        with open(log_path, "w") as log:
            code = subprocess.call(train_argv(run), cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
        print(f"    exit {code} in {seconds:.1f}s", flush=True)
        results.append((run, code, seconds))
    return results


def build_parser(prog: str = "ode-lm sweep") -> argparse.ArgumentParser:
    p = cli.doc_parser(prog, __doc__)
    p.add_argument("sweep_file", help="configs/sweeps/<name>.gin")
    p.add_argument("--root", required=True, help="parent of the runs' model dirs (local or gs://)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--run", action="store_true", help="train the runs here, one by one")
    mode.add_argument("--launch_tpu", metavar="TPU", help="print launch/tpu_vm.sh commands")
    p.add_argument("--zone", help="with --launch_tpu")
    p.add_argument("--project", help="with --launch_tpu")
    p.add_argument("--only", help="comma-separated run names to keep")
    p.add_argument("--gin.Sweep.FIELD=VALUE", dest="sweep_override", action="store_true",
                   help="override a Sweep.* binding of the file (--gin.Sweep.widths=[64,128])")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm sweep") -> int:
    p = build_parser(prog)
    args, rest = p.parse_known_args(argv)
    overrides = [a for a in rest if a.startswith("--gin.Sweep.")]
    unknown = [a for a in rest if a not in overrides]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)} (sweep overrides look like "
                "--gin.Sweep.widths=[64,128])")
    if args.launch_tpu and not args.zone:
        p.error("--launch_tpu needs --zone")
    return cli.run_command(prog, lambda: run(args, overrides, prog))


def run(args: argparse.Namespace, overrides: list[str], prog: str = "ode-lm sweep") -> int:
    spec = parse_sweep(args.sweep_file, overrides)
    runs = expand(spec, args.root)
    if args.only:
        keep = set(args.only.split(","))
        missing = keep - {r.name for r in runs}
        if missing:
            raise ValueError(f"--only names {sorted(missing)} are not in the sweep")
        runs = [r for r in runs if r.name in keep]
    if args.launch_tpu:
        for r in runs:
            print(launch_command(r, args.launch_tpu, args.zone, args.project))
        return 0
    if not args.run:
        for r in runs:
            print(f"{r.name}\t{shlex.join(r.gin_flags())}")
        return 0
    write_manifest(spec, runs, args.root)
    results = run_locally(runs, os.path.join(args.root, "logs"))
    failed = [r.name for r, code, _ in results if code]
    total = sum(s for *_, s in results)
    print(f"{len(results) - len(failed)}/{len(results)} runs finished in {total:.0f}s")
    if failed:
        print(f"{prog}: error: failed runs: {', '.join(failed)} (see {args.root}/logs)",
              file=sys.stderr)
        return cli.EXIT_FAILURE
    return 0
