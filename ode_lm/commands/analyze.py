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
import time
from collections.abc import Sequence

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


def run(args: argparse.Namespace) -> list[str]:
    import numpy as np

    from ode_lm.analysis import commands
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
        _, lines = commands.run_spectral(model, args.out, times=times, mlp_units=args.mlp_units,
                                         seed=args.seed, compare=compare)
        return head + lines
    tok = None
    if args.tokens is None:
        tok = commands.resolve_tokenizer(args.model_dir, args.data_dir, args.tokenizer)
    tokens, pieces = commands.read_tokens(tok, args.text, args.text_file, args.tokens)
    if args.command == "lyapunov":
        _, lines = commands.run_lyapunov(
            model, tokens, pieces, args.out, position=args.position, num_steps=args.num_steps,
            solver=args.solver, num_exponents=args.num_exponents, score=args.score,
            chunk_size=args.chunk_size)
    else:
        _, lines = commands.run_trajectory(model, tokens, args.out, num_steps=args.num_steps,
                                           solver=args.solver, times=args.times)
    return head + [f"{len(tokens)} tokens"] + lines


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm analyze") -> int:
    args = build_parser(prog).parse_args(argv)
    return cli.run_command(prog, lambda: analyze(args))


def analyze(args: argparse.Namespace) -> int:
    from ode_lm.analysis.commands import write_summary

    start = time.perf_counter()
    lines = run(args)
    lines.append(f"{args.command} took {time.perf_counter() - start:.1f} s")
    write_summary(args.out, args.command, lines)
    print("\n".join(lines))
    return 0
