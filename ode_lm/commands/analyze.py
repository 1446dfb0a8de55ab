"""Look inside a trained model: trajectories, eigen-spectra, token Lyapunov exponents.

  ode-lm analyze spectral   --model_dir=DIR [--step=N] [--num_times=101] --out=OUT
  ode-lm analyze lyapunov   --model_dir=DIR --text="..." [--num_steps=M] --out=OUT
  ode-lm analyze trajectory --model_dir=DIR --text_file=F [--times=0,0.33,1] --out=OUT

Works on checkpoints of the ODE model (any flavour) and of the discrete baselines. The
tokenizer is the one the run's data manifest names (found through MODEL_DIR/data_config.json,
or give --data_dir / --tokenizer); --tokens=1,2,3 skips tokenization. See the README's
analysis section for what each figure means.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from ode_lm import cli

COMMANDS = ("trajectory", "spectral", "lyapunov")


def build_parser(prog: str = "ode-lm analyze") -> argparse.ArgumentParser:
    from ode_lm.models.config import SOLVERS

    p = cli.doc_parser(prog, __doc__)
    p.add_argument("command", choices=COMMANDS, help="the analysis to run")
    p.add_argument("--model_dir", required=True, help="a training run directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--text", default=None)
    p.add_argument("--text_file", default=None)
    p.add_argument("--tokens", default=None, help="comma-separated token ids instead of text")
    p.add_argument("--data_dir", default=None, help="prepared data dir (its manifest)")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec, overrides the manifest")
    p.add_argument("--num_steps", type=int, default=None, help="ODE solver steps M")
    p.add_argument("--solver", default=None, choices=SOLVERS)
    # spectral
    p.add_argument("--num_times", type=int, default=101, help="spectral: t values in [0, 1]")
    p.add_argument("--times", type=cli.float_list, default=None,
                   help="spectral / trajectory: explicit comma-separated t values")
    p.add_argument("--mlp_units", type=int, default=None,
                   help="spectral: random subset of MLP hidden units (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare_dir", default=None,
                   help="spectral: a second run (e.g. a vanilla baseline) to overlay")
    # lyapunov
    p.add_argument("--position", type=int, default=-1, help="lyapunov: output position j")
    p.add_argument("--num_exponents", type=int, default=None,
                   help="lyapunov: exponents per token (default: the model width)")
    p.add_argument("--score", default="max", choices=("max", "sum"))
    p.add_argument("--chunk_size", type=int, default=64, help="lyapunov: VJPs at once")
    return p


def resolve_tokenizer(model_dir: str, data_dir: str | None = None,
                      tokenizer: str | None = None):
    """The run's tokenizer: --tokenizer, else the manifest of --data_dir or of the run's data
    dir, else the run's DataConfig.tokenizer (``training.run_dir``)."""
    from ode_lm.data import load_manifest
    from ode_lm.data.tokenizers import get_tokenizer
    from ode_lm.gin_setup import run_dir

    run_data = run_dir(model_dir).data_config() if tokenizer is None or data_dir is None else None
    if data_dir is None and run_data is not None:
        data_dir = run_data.data_dir
    if tokenizer is None and data_dir is not None:
        tokenizer = load_manifest(data_dir)["tokenizer"]["spec"]
    if tokenizer is None and run_data is not None:
        tokenizer = run_data.tokenizer
    if tokenizer is None:
        raise ValueError(f"--model_dir={model_dir}: no data_config.json naming the data; pass "
                         "--data_dir=DIR (a prepared data dir) or --tokenizer=SPEC or --tokens")
    return get_tokenizer(tokenizer, data_dir)


def read_tokens(tok, text: str | None, text_file: str | None,
                tokens: str | None) -> tuple[Any, list[str]]:
    """Token ids ``[T]`` and the text of each token from --text / --text_file / --tokens."""
    import numpy as np

    given = [x is not None for x in (text, text_file, tokens)]
    if sum(given) != 1:
        raise cli.UsageError("give exactly one of --text, --text_file, --tokens")
    if tokens is not None:
        try:
            ids = np.array([int(x) for x in tokens.split(",") if x.strip()], np.int64)
        except ValueError:
            raise cli.UsageError(f"--tokens={tokens!r}: expected comma-separated integers"
                                 ) from None
    else:
        if text_file is not None:
            if not os.path.isfile(text_file):
                raise FileNotFoundError(f"--text_file={text_file}: no such file")
            text = pathlib.Path(text_file).read_text(encoding="utf-8")
        if not text:
            raise ValueError("the input text is empty")
        if tok is None:
            raise ValueError("--text needs a tokenizer (--data_dir / --tokenizer)")
        ids = np.asarray(tok.encode(text), np.int64)
    pieces = [tok.decode([int(i)]) if tok is not None else f"<{int(i)}>" for i in ids]
    return ids, pieces


def run(args: argparse.Namespace) -> list[str]:
    import numpy as np

    from ode_lm.analysis import reports
    from ode_lm.training.saved_run import load_model

    model, run = load_model(args.model_dir, args.step)
    config, step = run.config, run.step
    head = [f"{args.model_dir} @ step {step}: {config.architecture} / {config.flavour}, "
            f"width {config.d_model}, {config.num_heads} heads"]
    if args.command == "spectral":
        if args.num_times < 1:
            raise ValueError(f"--num_times={args.num_times}: must be >= 1")
        times = args.times if args.times is not None else np.linspace(0, 1, args.num_times)
        compare = load_model(args.compare_dir)[0] if args.compare_dir else None
        _, lines = reports.run_spectral(model, args.out, times=times, mlp_units=args.mlp_units,
                                         seed=args.seed, compare=compare)
        return head + lines
    tok = None
    if args.tokens is None:
        tok = resolve_tokenizer(args.model_dir, args.data_dir, args.tokenizer)
    tokens, pieces = read_tokens(tok, args.text, args.text_file, args.tokens)
    if args.command == "lyapunov":
        _, lines = reports.run_lyapunov(
            model, tokens, pieces, args.out, position=args.position, num_steps=args.num_steps,
            solver=args.solver, num_exponents=args.num_exponents, score=args.score,
            chunk_size=args.chunk_size)
    else:
        _, lines = reports.run_trajectory(model, tokens, args.out, num_steps=args.num_steps,
                                           solver=args.solver, times=args.times)
    return head + [f"{len(tokens)} tokens"] + lines


def check_flags(args: argparse.Namespace) -> None:
    """The flags' own values, before a checkpoint is read: a bad one is a usage error."""
    if args.num_steps is not None and args.num_steps < 1:
        raise cli.UsageError(f"--num_steps={args.num_steps}: must be >= 1")
    for flag in ("num_times", "mlp_units", "chunk_size", "num_exponents"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise cli.UsageError(f"--{flag}={value}: must be >= 1")
    bad = [t for t in args.times or () if not 0.0 <= t <= 1.0]
    if bad:
        raise cli.UsageError(f"--times={','.join(map(str, args.times))}: {bad[0]} is outside "
                             "[0, 1]")
    cli.check_out_dir(args.out)
    if args.data_dir is not None:
        cli.check_out_dir(args.data_dir, "--data_dir")


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm analyze") -> int:
    args = build_parser(prog).parse_args(argv)
    cli.setup_logging()
    return cli.run_command(prog, lambda: analyze(args))


def analyze(args: argparse.Namespace) -> int:
    from ode_lm.analysis.reports import write_summary

    check_flags(args)
    start = time.perf_counter()
    lines = run(args)
    lines.append(f"{args.command} took {time.perf_counter() - start:.1f} s")
    write_summary(args.out, args.command, lines)
    print("\n".join(lines))
    return 0
