"""``ode-lm eval --model_dir=DIR [--num_steps=M[,M2...]] [--solver=rk4] [--step=S]``.

Evaluates a saved run on its validation split: exact token-weighted loss and perplexity,
at the trained number of ODE steps or any others (a depth sweep) with any solver, or with an
adaptive solver (``--solver=adaptive --rtol=1e-3``: Bogacki–Shampine 3(2), or ``dopri5``),
which also reports the mean number of vector-field evaluations (NFE) per batch; the run's
own solver and N are evaluated too, and every other setting is printed with its gap to
them. The data
and model settings come from ``MODEL_DIR/{data,model}_config.json``; the mesh is all local
devices.
``--solves="euler:4,6,8 rk4:8 adaptive:1e-3"`` evaluates several solves in one call (one
restore, one data pass per setting): space-separated groups ``SOLVER:N,N,...`` for a
fixed-grid solver (euler, midpoint, rk4) at each N, ``SOLVER:RTOL,...`` for an adaptive one
(adaptive, bosh3, dopri5) at each tolerance, or a bare ``N,N,...`` for the run's own solver;
the run's own solver and N are always evaluated too, and every other setting is printed
with its gap to them (the depth-gap figure the trainer logs, ``training.metric_names``).
``--log`` appends the results to MODEL_DIR/metrics.jsonl as one row at the checkpoint's step,
in the trainer's format, so ``ode-lm depth-gap table/plot`` shows them.
``--lm_eval_tasks=TASKS [--lm_eval_include_path=DIR]`` runs lm-eval tasks on the checkpoint
instead (``ode_lm.harness``; at each ``--num_steps``), with no export.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ode_lm import cli

DESCRIPTION = ("Evaluate a saved run on its validation split (loss, perplexity; NFE for "
               "adaptive solvers) at any number of ODE steps and solver, or on lm-eval tasks.")


SOLVES_HELP = """--solves syntax: space-separated groups, in one quoted argument
  euler:4,6,8       a fixed-grid solver (euler | midpoint | rk4) at each N
  adaptive:1e-3     an adaptive solver (adaptive | bosh3 | dopri5) at each rtol
  8,12              the run's own solver at each N
  rk4:steps=8       a value may also be written as the eval figures' names write it
The run's own solver and N are always evaluated; each other setting's gap to them is printed
(as the trainer logs it). --log appends the row to MODEL_DIR/metrics.jsonl."""


def parse_solves(text: str) -> list:
    """``--solves`` → ``[Solve, ...]`` in the order given (``SOLVES_HELP``,
    ``models.solve.parse_solves``); a bad group is a usage error naming it."""
    from ode_lm.models.solve import parse_solves as parse

    try:
        return parse(text, "--solves")
    except ValueError as e:
        raise cli.UsageError(str(e)) from None


def parse_args(argv: Sequence[str], prog: str = "ode-lm-eval") -> argparse.Namespace:
    p = cli.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=SOLVES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", required=True)
    p.add_argument("--num_steps", type=cli.int_list, default=None,
                   help="ODE steps, comma-separated for a sweep (default: the model's)")
    p.add_argument("--solver", default=None,
                   help="euler | midpoint | rk4 | adaptive (bosh3) | dopri5 (default: the model's)")
    p.add_argument("--rtol", type=float, default=None,
                   help="adaptive solvers: relative tolerance (default: ModelConfig.rtol)")
    p.add_argument("--atol", type=float, default=None,
                   help="adaptive solvers: absolute tolerance (default: ModelConfig.atol)")
    p.add_argument("--solves", default=None, metavar="'SOLVER:N,... SOLVER:RTOL,...'",
                   help="several solves in one call, e.g. \"euler:4,6,8 rk4:8 adaptive:1e-3\" "
                        "(instead of --num_steps/--solver/--rtol); each with its gap to the "
                        "run's own solver and N")
    p.add_argument("--log", action="store_true",
                   help="append the results to MODEL_DIR/metrics.jsonl at the checkpoint's "
                        "step (what ode-lm depth-gap reads); validation split only, refused "
                        "at once while a run trains there")
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
    adaptive), and each setting's depth gap as the trainer logs it."""
    from ode_lm.gin_setup import run_dir
    from ode_lm.training.evaluation import sweep_solves
    from ode_lm.training.saved_run import load_run

    cli.check_solver_flags(solver, rtol, atol)
    cli.check_tolerances_used(solver, rtol, atol, model_dir)
    run = load_run(model_dir, step, read_run=run_dir)
    return _own_and(run, run.evaluator(split), sweep_solves(num_steps, solver, rtol), atol)


def evaluate_solves(model_dir: str, solves: Sequence, step: int | None = None,
                    split: str = "validation", atol: float | None = None) -> dict[str, float]:
    """``evaluate_run`` at each of ``solves`` (``parse_solves``), the run's own solver and N
    among them always, so that every other setting has its depth gap."""
    from ode_lm.gin_setup import run_dir
    from ode_lm.training.saved_run import load_run

    run = load_run(model_dir, step, read_run=run_dir)
    return _own_and(run, run.evaluator(split), solves, atol)


def _own_and(run, evaluator, solves: Sequence, atol: float | None) -> dict[str, float]:
    """``solves`` and the run's own solver and N (evaluated too when not among them), so
    that every other setting has its gap to it."""
    from ode_lm.training.metric_names import Solve

    own = [] if "" in evaluator.settings(solves) else [Solve()]
    return _with_gaps(run, evaluator.evaluate(run.params, [*own, *solves], atol=atol))


def _with_gaps(run, sweep: dict[str, float]) -> dict[str, float]:
    """The checkpoint's step, the figures, and each setting's gap to the run's own."""
    from ode_lm.training import metric_names as names
    from ode_lm.training.evaluation import depth_gaps

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
    cli.check_tolerances_used(args.solver, args.rtol, args.atol, args.model_dir)
    tasks = harness.parse_tasks(args.lm_eval_tasks)
    harness.task_manager(tasks, args.lm_eval_include_path)  # bad tasks/paths before the restore
    run = load_run(args.model_dir, args.step, read_run=run_dir)
    tokenizer = get_tokenizer(run.data_config.tokenizer, run.data_config.data_dir)
    return {"step": float(run.step), **harness.evaluate_model(
        run.model(), tokenizer, tasks, num_steps=steps, solver=args.solver, rtol=args.rtol,
        atol=args.atol, include_path=args.lm_eval_include_path, limit=args.lm_eval_limit,
        num_fewshot=args.lm_eval_num_fewshot)}


def log_results(model_dir: str, results: dict[str, float]) -> str:
    """Append ``results`` as one metrics row at their step, as the trainer writes its evals
    (``metrics.JsonlWriter``); the caller holds the run's lock (``run``: from before the
    evaluation, so a run training there refuses it at once)."""
    from ode_lm.training.metrics import JsonlWriter
    from ode_lm.training.run_dir import RunDir

    path = RunDir(model_dir).metrics
    writer = JsonlWriter(path)
    try:
        writer.write_scalars(int(results["step"]),
                             {k: v for k, v in results.items() if k != "step"})
        writer.flush()
    finally:
        writer.close()
    return path


def run(args: argparse.Namespace) -> int:
    steps = args.num_steps or [None]
    if any(s is not None and s < 1 for s in steps):
        flag = ",".join(map(str, args.num_steps))
        raise cli.UsageError(f"--num_steps={flag}: every entry must be >= 1")
    solves = None
    if args.solves is not None:
        given = [f for f in ("num_steps", "solver", "rtol") if getattr(args, f) is not None]
        if given or args.lm_eval_tasks:
            other = f"--{given[0]}" if given else "--lm_eval_tasks"
            raise cli.UsageError(f"--solves and {other}: give one of them")
        solves = parse_solves(args.solves)
        cli.check_solver_flags(None, None, args.atol)
    if args.log:  # checked before any work: the split its names stand for, the lock
        if args.split != "validation" and not args.lm_eval_tasks:
            raise cli.UsageError(f"--log with --split={args.split}: a metrics row holds the "
                                 "validation split's figures (what depth-gap reads); drop "
                                 "--log to see this split's")
        if not os.path.isdir(args.model_dir):
            raise FileNotFoundError(f"--model_dir={args.model_dir}: no such directory")
        from ode_lm.training import run_lock

        with run_lock.hold(args.model_dir):  # not while a run trains there: refused at once
            results = _evaluate(args, steps, solves)
            path = log_results(args.model_dir, results)
    else:
        results = _evaluate(args, steps, solves)
    for k, v in results.items():
        print(f"{k}: {v:.4f}")
    from ode_lm.training.metric_names import GAP_PREFIX

    if any(k.startswith(GAP_PREFIX) for k in results):  # another setting than the own
        print(gap_lines(results))
    if args.log:
        print(f"logged to {path} at step {int(results['step'])}")
    print(json.dumps(results))
    return 0


def _evaluate(args: argparse.Namespace, steps: list, solves: list | None) -> dict[str, float]:
    if args.lm_eval_tasks:
        return lm_eval_run(args, steps)
    if solves is not None:
        return evaluate_solves(args.model_dir, solves, args.step, args.split, args.atol)
    return evaluate_run(args.model_dir, steps, args.solver, args.step, args.split,
                        args.rtol, args.atol)


def gap_lines(results: dict[str, float]) -> str:
    """One line per setting: its perplexity and its gap to the run's own solver and N."""
    from ode_lm.training import metric_names as names

    own = results[names.name(names.PERPLEXITY)]
    lines = [f"own solver and N: perplexity {own:.2f}"]
    for key, gap in results.items():
        if key.startswith(names.GAP_PREFIX):
            setting = key[len(names.GAP_PREFIX):]
            ppl = results.get(names.name(names.PERPLEXITY, f"@{setting}"), float("nan"))
            lines.append(f"{setting}: perplexity {ppl:.2f}, gap {gap:+.2%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm-eval") -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), prog)
    cli.setup_logging()
    return cli.run_command(prog, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
