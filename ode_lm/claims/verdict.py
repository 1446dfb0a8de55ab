"""A claim's verdict: one statistic per seed against a threshold fixed before the runs.

The rule, the same for every claim: ``holds`` when every seed's value is on the claimed side
of the threshold, ``does not hold`` when none is, ``inconclusive`` when the seeds' spread
(their range) straddles it. No value at all (a run that could not be made) is ``not run``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

HOLDS = "holds"
DOES_NOT_HOLD = "does not hold"
INCONCLUSIVE = "inconclusive"
NOT_RUN = "not run"
VERDICTS = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE, NOT_RUN)
SIDES = ("<=", ">=")


@dataclasses.dataclass(frozen=True)
class Threshold:
    """``statistic <side> value``: the side the paper's statement puts the statistic on."""

    side: str
    value: float
    unit: str = ""

    def __post_init__(self):
        if self.side not in SIDES:
            raise ValueError(f"Threshold.side={self.side!r}: expected one of {SIDES}")
        if not math.isfinite(self.value):
            raise ValueError(f"Threshold.value={self.value!r}: must be finite")

    def passes(self, x: float) -> bool:
        return x <= self.value if self.side == "<=" else x >= self.value

    def __str__(self) -> str:
        return f"{self.side} {self.value:g}{self.unit}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    verdict: str
    values: tuple[float, ...]  # one per seed, in seed order
    mean: float | None
    low: float | None  # the seeds' range
    high: float | None


def judge(values: Sequence[float], threshold: Threshold) -> Verdict:
    """The verdict of per-seed ``values`` (NaN counts as a value on neither side)."""
    vals = tuple(float(v) for v in values)
    if not vals:
        return Verdict(NOT_RUN, (), None, None, None)
    finite = [v for v in vals if math.isfinite(v)]
    mean = sum(finite) / len(finite) if finite else math.nan
    low, high = (min(finite), max(finite)) if finite else (math.nan, math.nan)
    passed = [math.isfinite(v) and threshold.passes(v) for v in vals]
    if all(passed):
        verdict = HOLDS
    elif not any(passed) and len(finite) == len(vals):
        verdict = DOES_NOT_HOLD
    else:
        verdict = INCONCLUSIVE
    return Verdict(verdict, vals, mean, low, high)
