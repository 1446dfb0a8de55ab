"""``ode-lm eval --model_dir=DIR [--num_steps=M[,M2...]] [--solver=rk4] [--step=S]``.

Evaluates a saved run on its validation split: exact token-weighted loss and perplexity,
at the trained number of ODE steps or any others (a depth sweep) with any solver, or with an
adaptive solver (``--solver=adaptive --rtol=1e-3``: Bogacki–Shampine 3(2), or ``dopri5``),
which also reports the mean number of vector-field evaluations (NFE) per batch. The data
and model settings come from ``MODEL_DIR/{data,model}_config.json``; the mesh is all local
devices.
``--lm_eval_tasks=TASKS [--lm_eval_include_path=DIR]`` runs lm-eval tasks on the checkpoint
instead (``ode_lm.harness``; at each ``--num_steps``), with no export.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ode_lm import cli

DESCRIPTION = ("Evaluate a saved run on its validation split (loss, perplexity; NFE for "
               "adaptive solvers) at any number of ODE steps and solver, or on lm-eval tasks.")


def parse_args(argv: Sequence[str], prog: str = "ode-lm-eval") -> argparse.Namespace:
    p = cli.ArgumentParser(prog=prog, description=DESCRIPTION)
    p.add_argument("--model_dir", required=True)
    p.add_argument("--num_steps", type=cli.int_list, default=None,
                   help="ODE steps, comma-separated for a sweep (default: the model's)")
    p.add_argument("--solver", default=None,
                   help="euler | midpoint | rk4 | adaptive (bosh3) | dopri5 (default: the model's)")
    p.add_argument("--rtol", type=float, default=None,
                   help="adaptive solvers: relative tolerance (default: ModelConfig.rtol)")
    p.add_argument("--atol", type=float, default=None,
                   help="adaptive solvers: absolute tolerance (default: ModelConfig.atol)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--split", default="validation")
    p.add_argument("--lm_eval_tasks", default=None,
                   help="lm-eval tasks (comma-separated names or YAML files) instead of the "
                        "validation loss: lm_eval/<task>/<metric>, no export needed")
    p.add_argument("--lm_eval_include_path", default=None,
                   help="a directory of local lm-eval task YAMLs")
    p.add_argument("--lm_eval_limit", type=int, default=None, help="documents per task")
    p.add_argument("--lm_eval_num_fewshot", type=int, default=None)
    return p.parse_args(argv)


def evaluate_run(model_dir: str, num_steps: Sequence[int | None] = (None,),
                 solver: str | None = None, step: int | None = None,
                 split: str = "validation", rtol: float | None = None,
                 atol: float | None = None) -> dict[str, float]:
    """{'step', 'eval/loss', 'eval/perplexity', 'eval/nfe', 'eval/loss@steps=M', ...,
    'eval/tokens'} for a saved run, named as the trainer names them
    (``training.metric_names``: no suffix at the model's own solver and N,
    '@steps=M' its solver at another M, '@rk4:steps=M' another solver, '@<solver>:rtol=<r>'
    adaptive), and ``eval/depth_gap/<setting>`` as the trainer logs it."""
    from ode_lm.gin_setup import run_dir
    from ode_lm.training import metric_names as names
    from ode_lm.training.evaluation import depth_gaps
    from ode_lm.training.saved_run import load_run

    cli.check_solver_flags(solver, rtol, atol)
    run = load_run(model_dir, step, read_run=run_dir)
    sweep = run.evaluator(split).sweep(run.params, num_steps, solver, rtol=rtol, atol=atol)
    # the trainer's drift metric, with the same names: each other setting against the own N
    figures = [names.parse(k) for k in sweep]
    settings = [f.suffix for f in figures if f.metric == names.PERPLEXITY and not f.eval_set]
    return {"step": float(run.step), **sweep, **depth_gaps(sweep, settings)}


def lm_eval_run(args: argparse.Namespace, steps: Sequence[int | None]) -> dict[str, float]:
    """``--lm_eval_tasks`` on the checkpoint at each N through ``harness.adapter.OdeLM``."""
    from ode_lm.data.tokenizers import get_tokenizer
    from ode_lm.gin_setup import run_dir
    from ode_lm.harness import run as harness
    from ode_lm.training.saved_run import load_run

    cli.check_solver_flags(args.solver, args.rtol, args.atol)
    tasks = harness.parse_tasks(args.lm_eval_tasks)
    harness.task_manager(tasks, args.lm_eval_include_path)  # bad tasks/paths before the restore
    run = load_run(args.model_dir, args.step, read_run=run_dir)
    tokenizer = get_tokenizer(run.data_config.tokenizer, run.data_config.data_dir)
    return {"step": float(run.step), **harness.evaluate_model(
        run.model(), tokenizer, tasks, num_steps=steps, solver=args.solver, rtol=args.rtol,
        atol=args.atol, include_path=args.lm_eval_include_path, limit=args.lm_eval_limit,
        num_fewshot=args.lm_eval_num_fewshot)}


def run(args: argparse.Namespace) -> int:
    steps = args.num_steps or [None]
    if any(s is not None and s < 1 for s in steps):
        flag = ",".join(map(str, args.num_steps))
        raise cli.UsageError(f"--num_steps={flag}: every entry must be >= 1")
    results = lm_eval_run(args, steps) if args.lm_eval_tasks else evaluate_run(
        args.model_dir, steps, args.solver, args.step, args.split, args.rtol, args.atol)
    for k, v in results.items():
        print(f"{k}: {v:.4f}")
    print(json.dumps(results))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm-eval") -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), prog)
    cli.setup_logging()
    return cli.run_command(prog, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
