"""``python -m ode_lm.eval --model_dir=DIR [--num_steps=M[,M2...]] [--solver=rk4] [--step=S]``.

Evaluates a saved run on its validation split: exact token-weighted loss and perplexity,
at the trained number of ODE steps or any others (a depth sweep) with any solver. The data
and model settings come from ``MODEL_DIR/config.gin``; the mesh is all local devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ode_lm.train import one_line, setup_logging, user_errors


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ode-lm-eval", description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", required=True)
    p.add_argument("--num_steps", default=None,
                   help="ODE steps, comma-separated for a sweep (default: the model's)")
    p.add_argument("--solver", default=None, help="euler | midpoint | rk4 (default: the model's)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--split", default="validation")
    return p.parse_args(argv)


def evaluate_run(model_dir: str, num_steps: Sequence[int | None] = (None,),
                 solver: str | None = None, step: int | None = None,
                 split: str = "validation") -> dict[str, float]:
    """{'eval/loss@steps=M': ..., 'eval/perplexity@steps=M': ...} for a saved run."""
    import math

    import gin
    import jax
    import optax

    from ode_lm import partitioning
    from ode_lm.data import make_eval_iterator, to_global_batch
    from ode_lm.models.config import SOLVERS
    from ode_lm.training import checkpoint as ckpt_lib
    from ode_lm.training import gin_setup
    from ode_lm.training import state as state_lib
    from ode_lm.training import step as step_lib
    from ode_lm.training.trainer import default_model_fn

    if solver is not None and solver not in SOLVERS:
        raise ValueError(f"--solver={solver!r}: expected one of {SOLVERS}")
    gin_file = os.path.join(model_dir, "config.gin")
    if not os.path.exists(gin_file):
        raise FileNotFoundError(f"{gin_file} not found: is --model_dir a training run?")
    model_config = ckpt_lib.load_model_config(model_dir)
    gin.clear_config()
    gin.parse_config_file(gin_file, skip_unknown=True)
    data_config = gin_setup.GinDataConfig()
    mesh = partitioning.create_mesh((1, -1, 1))
    rules = partitioning.axis_rules()
    spec = state_lib.build_state_spec(default_model_fn(model_config), optax.identity(), mesh,
                                      rules)
    params, step = ckpt_lib.restore_params(model_dir, spec.abstract_params, step)
    results: dict[str, float] = {"step": float(step)}
    for n in num_steps:
        eval_step = step_lib.make_eval_step(spec, n, solver)
        total, tokens = 0.0, 0.0
        with jax.set_mesh(mesh):
            for host_batch in make_eval_iterator(data_config, split):
                batch = to_global_batch(host_batch, mesh, rules)
                s, c = eval_step(params, batch)
                total, tokens = total + float(s), tokens + float(c)
        if tokens == 0:
            raise ValueError(f"split {split!r} of {data_config.data_dir} has no tokens")
        label = f"@steps={n or model_config.num_steps}"
        results[f"eval/loss{label}"] = total / tokens
        results[f"eval/perplexity{label}"] = math.exp(min(total / tokens, 80.0))
        results["eval/tokens"] = tokens
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    setup_logging()
    try:
        steps = [None] if not args.num_steps else [int(s) for s in args.num_steps.split(",")]
        if any(s is not None and s < 1 for s in steps):
            raise ValueError(f"--num_steps={args.num_steps}: every entry must be >= 1")
        results = evaluate_run(args.model_dir, steps, args.solver, args.step, args.split)
    except user_errors() as e:
        if os.environ.get("ODE_LM_DEBUG"):
            raise
        print(f"ode-lm-eval: error: {one_line(e)}", file=sys.stderr)
        return 1
    for k, v in results.items():
        print(f"{k}: {v:.4f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
