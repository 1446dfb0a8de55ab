"""The eval of a run at one or several depths, shared by ``Trainer.evaluate`` and ``ode_lm.eval``.

One naming for both, so a TensorBoard tag, a ``finetune_result.json`` key and the eval
CLI's output mean the same thing:

* ``eval/loss``, ``eval/perplexity``, ``eval/nfe``: at the model's own number of ODE steps N
  (``ModelConfig.num_steps``; asked for as ``None`` or as N itself);
* ``eval/loss@steps=M`` (and ``perplexity``, ``nfe``): at any other M (a depth sweep);
* ``eval/loss@<solver>:rtol=<rtol>``: an adaptive solver (its number of steps is its own);
* ``eval/tokens``: the token count of the split, once.

The token-weighted loop itself is ``step.run_eval``; the eval steps are jitted once per
(M, solver, rtol, atol) and kept, since the trainer evaluates every ``eval_every`` steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from ode_lm.models import solvers as solvers_lib
from ode_lm.training import step as step_lib
from ode_lm.training.state import StateSpec


def metric_suffix(num_steps: int | None, model_num_steps: int | None, solver: str | None = None,
                  rtol: float | None = None) -> str:
    """'' at the model's own N, '@steps=M' at another M, '@<solver>:rtol=<r>' adaptive."""
    if solvers_lib.is_adaptive(solver):
        return f"@{solver}:rtol={rtol:g}"
    if num_steps is None or num_steps == model_num_steps:
        return ""
    return f"@steps={num_steps}"


class Evaluator:
    """``params`` → eval results over every batch of ``batches()`` (a fresh pass each call).

    ``model_num_steps`` and ``model_rtol``: the model's own N and adaptive tolerance (what
    ``None`` means), for the names.
    """

    def __init__(self, spec: StateSpec, batches: Callable[[], Iterable[dict]], *,
                 model_num_steps: int | None, model_rtol: float | None = None,
                 what: str = "the eval pipeline", num_batches: int | None = None):
        self.spec, self.batches, self.what = spec, batches, what
        self.num_batches = num_batches  # for the progress line's ETA (None: no ETA)
        self.model_num_steps, self.model_rtol = model_num_steps, model_rtol
        self._steps: dict[tuple, Callable] = {}

    def result(self, params: Any, num_steps: int | None = None, solver: str | None = None, *,
               rtol: float | None = None, atol: float | None = None) -> step_lib.EvalResult:
        """Token-weighted loss, token count and mean NFE at one depth / solver."""
        key = (num_steps, solver, rtol, atol)
        if key not in self._steps:
            self._steps[key] = step_lib.make_eval_step(self.spec, num_steps, solver,
                                                       rtol=rtol, atol=atol)
        label = "eval" + metric_suffix(num_steps, self.model_num_steps, solver,
                                       rtol if rtol is not None else self.model_rtol)
        with jax.set_mesh(self.spec.mesh):
            return step_lib.run_eval(self._steps[key], params, self.batches(), what=self.what,
                                     total=self.num_batches, label=label)

    def sweep(self, params: Any, num_steps: Sequence[int | None] = (None,),
              solver: str | None = None, *, rtol: float | None = None,
              atol: float | None = None) -> dict[str, float]:
        """The named results at each entry of ``num_steps`` (an adaptive solver: once);
        an entry that names the model's own N twice is evaluated once."""
        adaptive = solvers_lib.is_adaptive(solver)
        results: dict[str, float] = {}
        for n in ([None] if adaptive else num_steps):
            label = metric_suffix(n, self.model_num_steps, solver,
                                  rtol if rtol is not None else self.model_rtol)
            if f"eval/loss{label}" in results:
                continue
            res = self.result(params, n, solver, rtol=rtol, atol=atol)
            results[f"eval/loss{label}"] = res.loss
            results[f"eval/perplexity{label}"] = res.perplexity
            results[f"eval/nfe{label}"] = res.nfe
            results.setdefault("eval/tokens", res.tokens)
        return results
