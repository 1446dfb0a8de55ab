"""``ode-lm sample --model_dir=RUN --prompt="..." [--num_steps=M] ...``.

Text generation from a training or fine-tuning run (LoRA merged), with a KV cache per ODE
solver evaluation (see ode_lm/generation.py). Several ``--prompt`` flags form one batch.
Prints the continuations and the decoding speed (tokens/s of a second, already compiled run).
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--draft", default=None,
                   help="self-speculative decoding: the same weights draft at SOLVER:STEPS "
                        "(e.g. euler:2) and the solve above verifies; auto: pick the draft "
                        "and --draft_tokens from acceptance on validation batches")
    p.add_argument("--draft_tokens", type=cli.int_list, default=[4],
                   help="tokens the draft proposes per verifier forward (k); several, "
                        "comma-separated: one timed line each")
    p.add_argument("--json", default=None,
                   help="with --draft: write each k's acceptance and tokens/s here")
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
    if args.draft is not None and (texts := run_speculative(args, model, run, tok, prompts,
                                                            kw)) is not None:
        return texts
    t0 = time.perf_counter()
    out = generate(model, prompts, **kw)
    first = time.perf_counter() - t0
    texts, counts = print_texts(args.prompt, out, tok)
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


def print_texts(prompts: list[str], out, tok) -> tuple[list[str], list[int]]:
    """Each prompt and its continuation (cut at end-of-text); (texts, new-token counts)."""
    texts, counts = [], []
    for prompt, ids in zip(prompts, out, strict=True):
        ids = list(ids)
        if tok.eos_id in ids:
            ids = ids[: ids.index(tok.eos_id)]
        counts.append(len(ids))
        texts.append(prompt + tok.decode(ids))
    for text in texts:
        print(text)
        print("-" * 40)
    return texts, counts


def run_speculative(args, model, run, tok, prompts, kw) -> list[str] | None:
    """Self-speculative decoding, then (unless --no_timing) both it and plain decoding at
    the verifier's solve timed once compiled, one line per k with the acceptance figures.
    None: ``--draft=auto`` found no draft faster than plain decoding (it said so)."""
    from ode_lm.generation import generate
    from ode_lm.models.solvers import is_adaptive
    from ode_lm.speculative import auto_draft, parse_solve, speculative_generate

    config = run.config
    verify = (args.num_steps or config.num_steps, args.solver or config.solver)
    if is_adaptive(verify[1]):
        raise cli.UsageError(f"--solver={verify[1]}: --draft needs a fixed-grid verifier "
                             "(its KV cache is what the draft's tokens are checked against)")
    if min(args.draft_tokens) < 1:
        raise cli.UsageError(f"--draft_tokens={','.join(map(str, args.draft_tokens))}: "
                             "each must be >= 1")
    if args.json is not None and os.path.isdir(args.json):
        raise cli.UsageError(f"--json={args.json}: a directory")
    if args.draft == "auto":
        choice = auto_draft(model, run.data_config, verify, run.model_dir)
        print(choice.text())
        if choice.draft is None:
            return None
        draft, ks = choice.draft, [choice.draft_tokens]
    else:
        draft, ks = parse_solve(args.draft, "--draft"), args.draft_tokens
    base = dict(draft=draft, verify=verify, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                vocab_limit=tok.vocab_size)
    pkw = {**kw, "num_steps": verify[0], "solver": verify[1]}
    plain = None if args.no_timing else generate(model, prompts, **pkw)  # compiled here
    texts, rows = [], []
    for k in ks:
        t0 = time.perf_counter()
        out, stats = speculative_generate(model, prompts, draft_tokens=k, **base)
        first = time.perf_counter() - t0
        if not texts:
            texts, counts = print_texts(args.prompt, out, tok)
        line = (f"step {run.step} | draft {draft[1]}:{draft[0]} x {k} -> verify "
                f"{verify[1]}:{verify[0]} | {count_text(counts, args.max_new_tokens)} | "
                f"acceptance {100 * stats.acceptance_rate:.0f}%, "
                f"{stats.tokens_per_round:.2f} tokens/verify")
        row = {"draft": list(draft), "verify": list(verify), "draft_tokens": k,
               "acceptance": stats.acceptance_rate, "tokens_per_verify": stats.tokens_per_round}
        if plain is None:
            print(line + f" | first call (compile + run) {first:.2f}s")
            rows.append(row)
            continue
        t_spec, t_plain = [], []
        for _ in range(3):  # alternated, so load hits both alike; the best of each
            t0 = time.perf_counter()
            speculative_generate(model, prompts, draft_tokens=k, **base)
            t_spec.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            generate(model, prompts, **pkw)
            t_plain.append(time.perf_counter() - t0)
        n = out.size
        same = bool((plain == out).all())
        verdict = "identical to plain" if same else (
            "sampled: the verifier's distribution" if args.temperature > 0 else
            "DIFFERS from plain greedy decoding")
        print(line + f" | {n / min(t_spec):,.1f} tokens/s against plain "
              f"{n / min(t_plain):,.1f} ({min(t_plain) / min(t_spec):.2f}x) | {verdict}")
        rows.append({**row, "tokens_per_s": n / min(t_spec), "plain_tokens_per_s":
                     n / min(t_plain), "speedup": min(t_plain) / min(t_spec),
                     "identical": same})
    if args.json:
        from ode_lm.provenance import provenance

        with open(args.json, "w") as f:
            json.dump({"model_dir": run.model_dir, "step": run.step, "prompts": args.prompt,
                       "max_new_tokens": args.max_new_tokens,
                       "temperature": args.temperature, "rows": rows,
                       "provenance": provenance()}, f, indent=1)
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
