"""The eval of a run at one or several settings, shared by ``Trainer.evaluate`` and ``ode-lm eval``.

Every figure is named by ``training.metric_names`` (``eval/loss``, ``eval/perplexity@rk4:steps=8``,
``eval/depth_gap/<setting>`` ...), so a TensorBoard tag, a metrics row's key, a fine-tune
result's key and the eval CLI's output mean the same thing. Here: the ``Evaluator`` (a run's
settings → named results), the trainer's drift figure ``depth_gaps`` (``ppl@<setting> / ppl
− 1`` of every other setting against the run's own solver and N: a long run's drift away from
a continuous model, one figure per setting) and the in-loop hooks (the run summary's
table is ``training.summary``). The token-weighted loop itself is ``step.run_eval``; the eval
steps are jitted once per (M, solver, rtol, atol) and kept, since the trainer evaluates every
``eval_every`` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from ode_lm.models.solve import OWN, Solve, is_adaptive
from ode_lm.training import metric_names as names
from ode_lm.training import step as step_lib
from ode_lm.training.metric_names import GAP_PREFIX
from ode_lm.training.state import StateSpec

LOSS, PERPLEXITY, NFE, TOKENS = names.LOSS, names.PERPLEXITY, names.NFE, names.TOKENS


def sweep_solves(num_steps: Sequence[int | None] = (None,), solver: str | None = None,
                 rtol: float | None = None) -> list[Solve]:
    """A depth sweep as settings: ``solver`` at each N (an adaptive solver: once, at rtol)."""
    if is_adaptive(solver):
        return [Solve(solver, rtol=rtol)]
    return [Solve(solver, n) for n in num_steps]


class Evaluator:
    """``params`` → eval results over every batch of ``batches()`` (a fresh pass each call).

    ``model_num_steps``, ``model_solver`` and ``model_rtol``: the run's own N, solver and
    adaptive tolerance (what ``None`` means), for the names.
    """

    def __init__(self, spec: StateSpec, batches: Callable[[], Iterable[dict]], *,
                 model_num_steps: int | None, model_solver: str | None = None,
                 model_rtol: float | None = None, what: str = "the eval pipeline",
                 num_batches: int | None = None):
        self.spec, self.batches, self.what = spec, batches, what
        self.num_batches = num_batches  # for the progress line's ETA (None: no ETA)
        self.model_num_steps, self.model_solver = model_num_steps, model_solver
        self.model_rtol = model_rtol
        self._steps: dict[tuple, Callable] = {}

    def result(self, params: Any, solve: Solve = OWN) -> step_lib.EvalResult:
        """Token-weighted loss, token count and mean NFE at one solve."""
        if solve not in self._steps:
            self._steps[solve] = step_lib.make_eval_step(self.spec, solve)
        label = names.EVAL + self.suffix(solve)
        with jax.set_mesh(self.spec.mesh):
            return step_lib.run_eval(self._steps[solve], params, self.batches(),
                                     what=self.what, total=self.num_batches, label=label)

    def resolve(self, solve: Solve) -> Solve:
        """``solve`` with the run's solver, N or rtol where it leaves them ``None``."""
        return solve.resolved(self.model_solver, self.model_num_steps, self.model_rtol)

    def suffix(self, solve: Solve) -> str:
        """The name suffix of ``solve`` (``metric_suffix`` with this run's own settings)."""
        return self.resolve(solve).relative(self.model_solver, self.model_num_steps).suffix

    def settings(self, solves: Sequence[Solve]) -> dict[str, Solve]:
        """suffix → resolved setting, in order, one entry per name (what ``evaluate`` runs)."""
        named: dict[str, Solve] = {}
        for solve in solves:
            named.setdefault(self.suffix(solve), self.resolve(solve))
        return named

    def evaluate(self, params: Any, solves: Sequence[Solve], *,
                 atol: float | None = None) -> dict[str, float]:
        """The named results at each setting; settings with one name are evaluated once."""
        results: dict[str, float] = {}
        for solve in solves:
            label = self.suffix(solve)
            if names.name(LOSS, label) in results:
                continue
            run = (Solve(solve.solver, rtol=solve.rtol, atol=atol) if solve.adaptive
                   else Solve(solve.solver, solve.num_steps))
            res = self.result(params, run)
            results[names.name(LOSS, label)] = res.loss
            results[names.name(PERPLEXITY, label)] = res.perplexity
            results[names.name(NFE, label)] = res.nfe
            results.setdefault(names.name(TOKENS), res.tokens)
        return results

    def sweep(self, params: Any, num_steps: Sequence[int | None] = (None,),
              solver: str | None = None, *, rtol: float | None = None,
              atol: float | None = None) -> dict[str, float]:
        """``evaluate`` at ``sweep_solves(num_steps, solver, rtol)``."""
        return self.evaluate(params, sweep_solves(num_steps, solver, rtol), atol=atol)


def depth_gaps(results: Mapping[str, float], settings: Iterable[str]) -> dict[str, float]:
    """``eval/depth_gap/<setting>`` = ``ppl@<setting> / ppl − 1`` for every suffix of
    ``settings`` but the run's own (``''``) that ``results`` holds; ``{}`` without the own
    perplexity. Computed from the logged perplexities, so it equals the same ratio of
    ``ode-lm eval``'s figures on the same checkpoint."""
    own = results.get(names.name(PERPLEXITY))
    if own is None:
        return {}
    return {names.gap_name(suffix): results[names.name(PERPLEXITY, suffix)] / own - 1.0
            for suffix in settings if suffix and names.name(PERPLEXITY, suffix) in results}


def gap_summary(results: Mapping[str, float]) -> str:
    """The eval row's compact drift figure: the largest gap in size, signed, and its
    setting (``'depth gap +1.8% at rk4:steps=24 (max of 3)'``); ``''`` without gaps."""
    gaps = {k[len(GAP_PREFIX):]: v for k, v in results.items() if k.startswith(GAP_PREFIX)}
    if not gaps:
        return ""
    setting, gap = max(gaps.items(), key=lambda kv: abs(kv[1]))
    return f"depth gap {gap:+.1%} at {setting} (max of {len(gaps)})"


# ------------------------------------------------------------------ in-loop hooks


@dataclasses.dataclass(frozen=True)
class EvalContext:
    """What an in-loop evaluation sees at one eval of the trainer: the current parameters
    at ``step``, the state spec, the run's data config and the trainer's ``Evaluator``
    (its eval steps jitted once per setting and kept)."""

    step: int
    params: Any
    spec: Any
    data_config: Any
    evaluator: Evaluator
    rules: Any = None  # the run's logical-axis rules (what eval sets shard their batches by)


class EvalHook:
    """One in-loop evaluation the trainer is handed (``Trainer(evals=[...])``): called at
    every eval with an ``EvalContext``, it returns ``{name: value}`` for the metrics."""

    def __call__(self, ctx: EvalContext) -> dict[str, float]:
        raise NotImplementedError

    def settings(self, evaluator: Evaluator) -> dict[str, Solve]:
        """The ODE settings it evaluates (name suffix -> Solve): the run summary's table."""
        return {}


class LossEval(EvalHook):
    """Loss, perplexity (and NFE) at each setting: the model's own N and solver, a depth
    sweep, other solvers (``Evaluator.evaluate``)."""

    def __init__(self, solves: Sequence[Solve]):
        self.solves = list(solves)

    @classmethod
    def from_config(cls, train_config: Any) -> LossEval:
        """The model's own solve, then ``TrainConfig.eval_solves``."""
        return cls([OWN, *train_config.solves])

    def __call__(self, ctx: EvalContext) -> dict[str, float]:
        return ctx.evaluator.evaluate(ctx.params, self.solves)

    def settings(self, evaluator: Evaluator) -> dict[str, Solve]:
        return evaluator.settings(self.solves)


class EvalSets(EvalHook):
    """Loss and perplexity at each setting on named eval sets (a mixture's components):
    ``eval/<name>/loss``, ``eval/<name>/perplexity`` (with the settings' suffixes), beside
    the overall figures. ``sets``: ``[(name, batches(mesh, rules))]``; the eval steps are
    the trainer's (jitted once per setting)."""

    def __init__(self, solves: Sequence[Solve],
                 sets: Sequence[tuple[str, Callable[[Any, Any], Iterable[dict]]]]):
        self.solves, self.sets = list(solves), list(sets)
        self._evaluators: dict[str, Evaluator] = {}

    def __call__(self, ctx: EvalContext) -> dict[str, float]:
        results: dict[str, float] = {}
        base = ctx.evaluator
        for name, batches in self.sets:
            if name not in self._evaluators:
                ev = Evaluator(ctx.spec, lambda b=batches: b(ctx.spec.mesh, ctx.rules),
                               model_num_steps=base.model_num_steps,
                               model_solver=base.model_solver, model_rtol=base.model_rtol,
                               what=f"eval set {name!r}")
                ev._steps = base._steps  # one jitted step per setting, shared
                self._evaluators[name] = ev
            for key, value in self._evaluators[name].evaluate(ctx.params, self.solves).items():
                figure = names.parse(key)
                if figure.metric not in (NFE, TOKENS):
                    results[names.name(figure.metric, figure.suffix, eval_set=name)] = value
        return results
