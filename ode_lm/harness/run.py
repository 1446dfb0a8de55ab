"""Running lm-eval tasks on an ode-lm model and naming the results ``lm_eval/<task>/<metric>``.

Why a task manager is cached and built without lm-eval's own tasks when it can: indexing
the ~15k built-in task files takes ~30 s on a CPU host, which would dominate a small
in-training eval every ``eval_every`` steps. When every requested task is a YAML file or is
found under ``include_path``, the built-ins are not indexed at all.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ode_lm.errors import UsageError
from ode_lm.training.evaluation import EvalContext, EvalHook
from ode_lm.training.metric_names import lm_eval_name

_TASK_MANAGERS: dict[tuple, Any] = {}


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RuntimeError("lm-eval is not installed: pip install -e '.[lmeval]'") from None


def parse_tasks(text: str | Sequence[str], flag: str = "--lm_eval_tasks") -> tuple[str, ...]:
    """'a,b' or ('a', 'b') -> ('a', 'b'); empty entries are an error."""
    items = text.split(",") if isinstance(text, str) else list(text)
    tasks = tuple(t.strip() for t in items)
    if not tasks or any(not t for t in tasks):
        raise UsageError(f"{flag}={text!r}: expected comma-separated lm-eval task names")
    return tasks


def task_manager(tasks: Sequence[str], include_path: str | None = None):
    """An lm-eval ``TaskManager`` that knows ``tasks`` (built once per process and setting)."""
    if include_path is not None and not os.path.isdir(include_path):
        raise FileNotFoundError(f"--lm_eval_include_path={include_path}: no such directory")
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    key = (tuple(tasks), include_path)
    if key not in _TASK_MANAGERS:
        local = TaskManager(include_path=include_path, include_defaults=False) \
            if include_path else None
        known = set(local.all_tasks) if local else set()
        if all(t in known or t.endswith((".yaml", ".yml")) and os.path.isfile(t)
               for t in tasks):
            _TASK_MANAGERS[key] = local or TaskManager(include_defaults=False)
        else:
            _TASK_MANAGERS[key] = TaskManager(include_path=include_path)
    known = set(_TASK_MANAGERS[key].all_tasks)
    missing = [t for t in tasks if t not in known and not os.path.isfile(t)]
    if missing:
        where = f" or in {include_path}" if include_path else ""
        raise KeyError(f"--lm_eval_tasks: {', '.join(missing)}: no such lm-eval task, group, "
                       f"tag or YAML file (lm-eval {_version()}{where})")
    return _TASK_MANAGERS[key]


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _versions_only(storage: dict[str, Any]) -> None:
    """Stands in for lm-eval's ``add_env_info``, which runs torch's environment probe (pip
    and nvidia-smi subprocesses, seconds) on every call; in a training loop that adds up."""
    storage["lm_eval_version"] = _version()


def simple_evaluate(lm: Any, tasks: Sequence[str], *, include_path: str | None = None,
                    limit: int | None = None, num_fewshot: int | None = None,
                    log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's result dict for an ``LM`` (ours or ``--model hf``'s), no stderr bootstrap."""
    require_lm_eval()
    import lm_eval
    from lm_eval import evaluator

    if limit is not None and limit < 1:
        raise ValueError(f"--lm_eval_limit={limit}: must be >= 1 (documents per task)")
    probe, evaluator.add_env_info = evaluator.add_env_info, _versions_only
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=task_manager(tasks, include_path),
            limit=limit, num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=log_samples)
    finally:
        evaluator.add_env_info = probe
    if results is None:  # only a non-zero rank of a distributed lm-eval gets None
        raise RuntimeError("lm-eval returned no results")
    return results


def metrics(results: dict[str, Any], suffix: str = "") -> dict[str, float]:
    """{'lm_eval/<task>/<metric>[:<filter>]<suffix>': value} for every numeric metric (filter
    'none', the default, is left out; standard errors are left out)."""
    out: dict[str, float] = {}
    for task, values in sorted(results["results"].items()):
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if not filt or "_stderr" in name or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(float(value)):
                label = name if filt == "none" else f"{name}:{filt}"
                out[lm_eval_name(task, label, suffix)] = float(value)
    return out


def evaluate_model(model: Any, tokenizer: Any, tasks: Sequence[str], *,
                   num_steps: Sequence[int | None] = (None,), solver: str | None = None,
                   rtol: float | None = None, atol: float | None = None,
                   include_path: str | None = None, limit: int | None = None,
                   num_fewshot: int | None = None, batch_size: int = 16) -> dict[str, float]:
    """lm-eval metrics of one model at each N, named as ``eval/`` is
    (``training.metric_names.metric_suffix``): no suffix at the model's own N, ``@steps=M`` at
    another M; an adaptive solve has one entry per call, unsuffixed."""
    require_lm_eval()
    from ode_lm.harness.adapter import OdeLM
    from ode_lm.models.solve import is_adaptive
    from ode_lm.training.metric_names import metric_suffix

    tasks = parse_tasks(tasks)
    out: dict[str, float] = {}
    for n in num_steps:
        lm = OdeLM(model, tokenizer, num_steps=n, solver=solver, rtol=rtol, atol=atol,
                   batch_size=batch_size)
        res = simple_evaluate(lm, tasks, include_path=include_path, limit=limit,
                              num_fewshot=num_fewshot)
        suffix = "" if is_adaptive(solver) else metric_suffix(
            n, getattr(model.config, "num_steps", None))
        out.update(metrics(res, suffix))
    return out


class LmEval(EvalHook):
    """The trainer's lm-eval hook: ``tasks`` on the current parameters at the model's N and
    ``solver`` at every eval (``lm_eval/<task>/<metric>``). Checked when built, before any
    step (lm-eval installed, the values sensible: a typo should not wait for the first eval).
    """

    def __init__(self, tasks: Sequence[str], *, include_path: str | None = None,
                 limit: int | None = None, solver: str | None = None,
                 what: str = "TrainConfig.lm_eval"):
        self.tasks = parse_tasks(tasks, f"{what}_tasks")
        if include_path is not None and not os.path.isdir(include_path):
            raise FileNotFoundError(f"{what}_include_path={include_path}: no such directory")
        if limit is not None and limit < 1:
            raise ValueError(f"{what}_limit={limit}: must be >= 1")
        require_lm_eval()
        self.include_path, self.limit, self.solver = include_path, limit, solver

    @classmethod
    def from_config(cls, train_config: Any) -> list[LmEval]:
        """``TrainConfig.lm_eval_*`` as hooks: [] without tasks, else one."""
        if not train_config.lm_eval_tasks:
            return []
        return [cls(train_config.lm_eval_tasks, include_path=train_config.lm_eval_include_path,
                    limit=train_config.lm_eval_limit)]

    def __call__(self, ctx: EvalContext) -> dict[str, float]:
        from flax import nnx

        from ode_lm.data.tokenizers import get_tokenizer

        model = nnx.merge(ctx.spec.graphdef, nnx.State(ctx.params), ctx.spec.rest)
        tokenizer = get_tokenizer(ctx.data_config.tokenizer, ctx.data_config.data_dir)
        return evaluate_model(model, tokenizer, self.tasks, solver=self.solver,
                              include_path=self.include_path, limit=self.limit)
