"""The names of eval figures: the one module that writes them and reads them back.

A TensorBoard tag, a metrics row's key, a fine-tune result's key and ``ode-lm eval``'s output
share one naming, ``eval[/<set>]/<metric>[@<setting>]``. A figure is plain only at the run's
own solver and N:

* ``eval/loss``, ``eval/perplexity``, ``eval/nfe``: the run's own solver
  (``ModelConfig.solver``) at its own N (``ModelConfig.num_steps``);
* ``eval/loss@steps=M`` (and ``perplexity``, ``nfe``): the run's own solver at another M;
* ``eval/loss@<solver>:steps=M``: another fixed-grid solver, at any M (its own N included);
* ``eval/loss@<solver>:rtol=<rtol>``: an adaptive solver (its number of steps is its own);
* ``eval/tokens``: the token count of the split, once;
* ``eval/<set>/loss`` ...: the same figures on a named eval set (a mixture's component);
* ``eval/depth_gap/<setting>``: ``ppl@<setting> / ppl − 1`` against the run's own solver and N;
* ``lm_eval/<task>/<metric><suffix>``: an lm-eval task's figure, suffixed the same way.

A setting is a ``Solve``; ``parse_solve`` reads the words a name writes after its ``@``
(``'rk4:steps=8'``, ``'adaptive:rtol=1e-3'``, ``'steps=8'``: also ``TrainConfig.eval_solves``
and the commands' flags). ``metric_suffix`` writes them from an absolute setting and the
run's own; ``parse`` reads a whole name back into (metric, setting, set) and ``str`` of the
result writes it again. Nothing here imports jax: the commands that only read metrics files
stay light (the solver lists are ``models.config``'s, asked for when a setting is read).
"""

from __future__ import annotations

import dataclasses

EVAL = "eval"
LM_EVAL = "lm_eval"
LOSS, PERPLEXITY, NFE, TOKENS, DEPTH_GAP = "loss", "perplexity", "nfe", "tokens", "depth_gap"
GAP_PREFIX = "eval/depth_gap/"
SOLVE_FORMS = "'<solver>:steps=<N>', '<adaptive solver>:rtol=<r>' or 'steps=<N>'"


def _solvers() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(fixed-grid, adaptive) solver names: ``models.config``'s lists (imported when asked)."""
    from ode_lm.models.config import ADAPTIVE_SOLVERS, SOLVERS

    return SOLVERS, ADAPTIVE_SOLVERS


def is_adaptive(solver: str | None) -> bool:
    return solver is not None and solver in _solvers()[1]


@dataclasses.dataclass(frozen=True)
class Solve:
    """One eval setting: a fixed-grid solver at N steps, or an adaptive solver at a relative
    tolerance; ``None`` fields are the run's own (its solver, N, rtol)."""

    solver: str | None = None
    num_steps: int | None = None
    rtol: float | None = None

    @property
    def adaptive(self) -> bool:
        return is_adaptive(self.solver)

    @property
    def words(self) -> str:
        """What a name writes after ``@`` (``''``: the run's own solver and N)."""
        if self.adaptive:
            return f"{self.solver}:rtol={self.rtol:g}"
        if self.num_steps is None:
            return ""
        return f"steps={self.num_steps}" if self.solver is None else \
            f"{self.solver}:steps={self.num_steps}"

    @property
    def suffix(self) -> str:
        """``'@' + words``, or ``''`` at the run's own solver and N."""
        return f"@{self.words}" if self.words else ""


def parse_solve(spec: str, what: str = "eval setting") -> Solve:
    """``'rk4:steps=8'`` / ``'adaptive:rtol=1e-3'`` / ``'steps=8'`` (the run's solver) →
    ``Solve``: the words a metric name writes after its ``@``. ``what`` names the flag."""
    solver, _, setting = spec.rpartition(":")
    key, eq, value = setting.partition("=")
    bad = ValueError(f"{what}={spec!r}: expected {SOLVE_FORMS}")
    fixed, adaptive_solvers = _solvers()
    if solver and solver not in fixed + adaptive_solvers:
        raise ValueError(f"{what}={spec!r}: solver {solver!r} is not one of "
                         f"{fixed + adaptive_solvers}")
    adaptive = is_adaptive(solver)
    if not eq or key != ("rtol" if adaptive else "steps"):
        raise bad
    try:
        number = float(value) if adaptive else int(value)
    except ValueError:
        raise bad from None
    if not number > 0:
        raise ValueError(f"{what}={spec!r}: {key} must be > 0")
    return Solve(solver or None, rtol=number) if adaptive else Solve(solver or None, number)


def relative(num_steps: int | None, model_num_steps: int | None, solver: str | None = None,
             rtol: float | None = None, *, model_solver: str | None = None) -> Solve:
    """A setting as its name writes it: ``Solve()`` at the run's own solver (``solver`` None
    or ``model_solver``) and N, ``Solve(None, M)`` its solver at another M, ``Solve(s, M)``
    another fixed-grid solver, ``Solve(s, rtol=r)`` an adaptive one."""
    if is_adaptive(solver):
        return Solve(solver, rtol=rtol)
    n = model_num_steps if num_steps is None else num_steps
    if solver is None or solver == model_solver:
        return Solve() if n == model_num_steps else Solve(None, n)
    return Solve(solver, n)


def metric_suffix(num_steps: int | None, model_num_steps: int | None, solver: str | None = None,
                  rtol: float | None = None, *, model_solver: str | None = None) -> str:
    """What follows ``eval/loss`` in an eval figure's name: '' at the run's own solver
    (``solver`` None or ``model_solver``) and N, '@steps=M' for its solver at another M,
    '@<solver>:steps=M' for another fixed-grid solver, '@<solver>:rtol=<r>' adaptive."""
    return relative(num_steps, model_num_steps, solver, rtol, model_solver=model_solver).suffix


def name(metric: str, suffix: str = "", eval_set: str | None = None) -> str:
    """``eval[/<eval_set>]/<metric><suffix>``; ``metric=DEPTH_GAP``: ``gap_name(suffix)``."""
    if metric == DEPTH_GAP:
        return gap_name(suffix)
    return f"{EVAL}/{eval_set}/{metric}{suffix}" if eval_set else f"{EVAL}/{metric}{suffix}"


def gap_name(suffix: str) -> str:
    """``eval/depth_gap/<setting>`` of a setting's suffix (``'@rk4:steps=8'``)."""
    return f"{GAP_PREFIX}{suffix[1:]}"


def lm_eval_name(task: str, metric: str, suffix: str = "") -> str:
    """``lm_eval/<task>/<metric><suffix>``: an lm-eval figure, suffixed as the eval figures."""
    return f"{LM_EVAL}/{task}/{metric}{suffix}"


@dataclasses.dataclass(frozen=True)
class MetricName:
    """An eval figure's name read back: the figure (``LOSS``, ``PERPLEXITY``, ``NFE``,
    ``TOKENS``, ``DEPTH_GAP``), its setting relative to the run (``Solve()``: the run's own
    solver and N) and its eval set (None: the run's validation split)."""

    metric: str
    solve: Solve = Solve()
    eval_set: str | None = None

    @property
    def suffix(self) -> str:
        return self.solve.suffix

    def __str__(self) -> str:
        return name(self.metric, self.suffix, self.eval_set)


def parse(key: str) -> MetricName | None:
    """``'eval/perplexity@rk4:steps=8'`` → ``MetricName('perplexity', Solve('rk4', 8))``;
    None for a key that is not an eval figure's name (``'step'``, ``'train/loss'``).
    A setting that does not read (``'eval/loss@rk5:steps=2'``) raises ``ValueError``."""
    if key.startswith(GAP_PREFIX):
        return MetricName(DEPTH_GAP, parse_solve(key[len(GAP_PREFIX):], key))
    head, at, words = key.partition("@")
    parts = head.split("/")
    if parts[0] != EVAL or len(parts) not in (2, 3) or not all(parts):
        return None
    solve = parse_solve(words, key) if at else Solve()
    return MetricName(parts[-1], solve, parts[1] if len(parts) == 3 else None)


def is_metric(key: str, *metrics: str) -> bool:
    """Whether ``key`` names one of ``metrics`` (any setting, any eval set)."""
    parsed = parse(key)
    return parsed is not None and parsed.metric in metrics
