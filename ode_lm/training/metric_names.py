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

A setting is a ``models.solve.Solve`` relative to the run (``None``: the run's own), whose
printer writes the words after ``@`` (``'rk4:steps=8'``, ``'adaptive:rtol=0.001'``,
``'steps=8'``) and whose parser (``Solve.parse``) reads them back: the same text as
``TrainConfig.eval_solves`` and the commands' flags. ``metric_suffix`` writes them from an
absolute setting and the run's own; ``parse`` reads a whole name back into (metric,
setting, set) and ``str`` of the result writes it again. Nothing here imports jax: the
commands that only read metrics files stay light.
"""

from __future__ import annotations

import dataclasses

from ode_lm.models.solve import Solve

EVAL = "eval"
LM_EVAL = "lm_eval"
LOSS, PERPLEXITY, NFE, TOKENS, DEPTH_GAP = "loss", "perplexity", "nfe", "tokens", "depth_gap"
GAP_PREFIX = "eval/depth_gap/"


def metric_suffix(num_steps: int | None, model_num_steps: int | None, solver: str | None = None,
                  rtol: float | None = None, *, model_solver: str | None = None) -> str:
    """What follows ``eval/loss`` in an eval figure's name: '' at the run's own solver
    (``solver`` None or ``model_solver``) and N, '@steps=M' for its solver at another M,
    '@<solver>:steps=M' for another fixed-grid solver, '@<solver>:rtol=<r>' adaptive."""
    return Solve(solver, num_steps, rtol).relative(model_solver, model_num_steps).suffix


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
        return MetricName(DEPTH_GAP, Solve.parse(key[len(GAP_PREFIX):], key))
    head, at, words = key.partition("@")
    parts = head.split("/")
    if parts[0] != EVAL or len(parts) not in (2, 3) or not all(parts):
        return None
    solve = Solve.parse(words, key) if at else Solve()
    return MetricName(parts[-1], solve, parts[1] if len(parts) == 3 else None)


def is_metric(key: str, *metrics: str) -> bool:
    """Whether ``key`` names one of ``metrics`` (any setting, any eval set)."""
    parsed = parse(key)
    return parsed is not None and parsed.metric in metrics
