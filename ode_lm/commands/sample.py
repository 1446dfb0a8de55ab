"""``ode-lm sample --model_dir=RUN --prompt="..." [--num_steps=M] ...``.

Text generation from a training or fine-tuning run (LoRA merged), with a KV cache per ODE
solver evaluation (see ode_lm/generation.py). Several ``--prompt`` flags form one batch.
Prints the continuations and the decoding speed (tokens/s of a second, already compiled run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from ode_lm import cli

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_args(argv: Sequence[str], prog: str = "ode-lm-sample") -> argparse.Namespace:
    p = cli.ArgumentParser(prog=prog, description=__doc__.split("\n")[2])
    p.add_argument("--model_dir", required=True)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--num_steps", type=int, default=None, help="ODE solver steps M")
    p.add_argument("--solver", default=None,
                   help="euler | midpoint | rk4 (KV-cached) | adaptive | dopri5 (recomputed)")
    p.add_argument("--rtol", type=float, default=None, help="adaptive solvers: rtol")
    p.add_argument("--atol", type=float, default=None, help="adaptive solvers: atol")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--data_dir", default=None, help="prepared data dir holding the tokenizer")
    p.add_argument("--no_timing", action="store_true", help="skip the timed second run")
    return p.parse_args(argv)


def load_tokenizer(model_dir: str, data_dir: str | None):
    from ode_lm.data import load_manifest
    from ode_lm.data.manifest import MANIFEST, has_manifest
    from ode_lm.data.tokenizers import get_tokenizer
    from ode_lm.gin_setup import run_dir

    data_dir = data_dir or run_dir(model_dir).data_dir()
    if not has_manifest(data_dir):
        raise FileNotFoundError(f"no prepared data ({MANIFEST}) for {model_dir}; "
                                "pass --data_dir=DIR to name the tokenizer's data")
    manifest = load_manifest(data_dir)
    return get_tokenizer(manifest["tokenizer"]["spec"], data_dir)


def solve_text(args: argparse.Namespace, config) -> str:
    """The solve that made the text: its solver with M steps, or its tolerance."""
    from ode_lm.models.solvers import is_adaptive

    solver = args.solver or config.solver
    if is_adaptive(solver):
        rtol = config.rtol if args.rtol is None else args.rtol
        return f"{solver} rtol={rtol:g}"
    return f"{solver} M={args.num_steps or config.num_steps}"


def count_text(counts: list[int], max_new: int) -> str:
    """How many tokens each prompt got: fewer than asked when it reached end-of-text."""
    n = len(counts)
    prompts = f"{n} prompt{'s' if n > 1 else ''}"
    if all(c == max_new for c in counts):
        return f"{prompts} x {max_new} tokens"
    got = ", ".join(map(str, counts))
    return f"{prompts}: {got} of {max_new} tokens (stopped at end-of-text)"


def run(args: argparse.Namespace) -> list[str]:
    from ode_lm.generation import check_num_steps, generate
    from ode_lm.training.saved_run import load_model

    check_num_steps(args.num_steps)
    cli.check_solver_flags(args.solver, args.rtol, args.atol)
    cli.check_tolerances_used(args.solver, args.rtol, args.atol, args.model_dir)
    if args.data_dir is not None:
        cli.check_out_dir(args.data_dir, "--data_dir")
    model, run = load_model(args.model_dir, args.step)
    config, step = run.config, run.step
    tok = load_tokenizer(args.model_dir, args.data_dir)
    prompts = [[int(i) for i in tok.encode(p)] or [tok.eos_id] for p in args.prompt]
    kw = dict(max_new_tokens=args.max_new_tokens, num_steps=args.num_steps, solver=args.solver,
              temperature=args.temperature, top_p=args.top_p, seed=args.seed,
              vocab_limit=tok.vocab_size, rtol=args.rtol, atol=args.atol)
    t0 = time.perf_counter()
    out = generate(model, prompts, **kw)
    first = time.perf_counter() - t0
    texts, counts = [], []
    for prompt, ids in zip(args.prompt, out, strict=True):
        ids = list(ids)
        if tok.eos_id in ids:
            ids = ids[: ids.index(tok.eos_id)]
        counts.append(len(ids))
        texts.append(prompt + tok.decode(ids))
    for text in texts:
        print(text)
        print("-" * 40)
    n = out.size
    line = f"step {step} | {solve_text(args, config)} | {count_text(counts, args.max_new_tokens)}" \
           f" | first call (compile + run) {first:.2f}s"
    if not args.no_timing:
        t0 = time.perf_counter()
        generate(model, prompts, **kw)
        dt = time.perf_counter() - t0
        line += f" | {n / dt:,.1f} tokens/s ({dt:.3f}s, compiled)"
    print(line)
    return texts


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm-sample") -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    cli.setup_logging()  # warnings as plain lines, not ``WARNING:ode_lm.checkpoint:...``

    def body() -> int:
        run(args)
        return 0

    return cli.run_command(prog, body)


if __name__ == "__main__":
    sys.exit(main())
