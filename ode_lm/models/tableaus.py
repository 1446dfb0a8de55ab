"""The Butcher tableaus: every solver ode-lm knows, by name, in one table.

Adding a solver is one ``TABLEAUS`` entry: its name is then a fixed-grid solver (no
embedded lower-order weights) or an adaptive one (``b_low`` set), everywhere: the settings'
checks, the CLIs' choices, the solve's parser and the docs' lists (a test holds them to
this table). ``SOLVERS`` and ``ADAPTIVE_SOLVERS`` are live views of it, not copies. No jax
here: ``models.config`` reads the names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tableau:
    """c: stage times as fractions of dt; a: the strictly lower-triangular stage
    coefficients (row i has i entries); b: solution weights; b_low: the embedded
    lower-order weights (adaptive pairs); order: order of b; fsal: last stage = f(x_new)."""

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    order: int
    b_low: tuple[float, ...] | None = None
    fsal: bool = False

    @property
    def stages(self) -> int:
        return len(self.c)

    def grid_offset(self, u: Any, dt: Any) -> Any:
        """The random grid offset for a draw u ∈ [0, dt), added to every stage time: a
        tableau that evaluates only at the step's end (c = (1,): Euler, as the paper) shifts
        back, t_{k+1} − u ∈ [t_k, t_{k+1}); one with stages inside the step is centred on
        its grid, u − dt/2."""
        return -u if all(c == 1.0 for c in self.c) else u - dt / 2


TABLEAUS: dict[str, Tableau] = {
    "euler": Tableau(c=(1.0,), a=((),), b=(1.0,), order=1),
    "midpoint": Tableau(c=(0.0, 0.5), a=((), (0.5,)), b=(0.0, 1.0), order=2),
    "rk4": Tableau(c=(0.0, 0.5, 0.5, 1.0), a=((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)),
                   b=(1 / 6, 1 / 3, 1 / 3, 1 / 6), order=4),
    "bosh3": Tableau(
        c=(0.0, 0.5, 0.75, 1.0),
        a=((), (0.5,), (0.0, 0.75), (2 / 9, 1 / 3, 4 / 9)),
        b=(2 / 9, 1 / 3, 4 / 9, 0.0), b_low=(7 / 24, 1 / 4, 1 / 3, 1 / 8), order=3, fsal=True),
    "dopri5": Tableau(
        c=(0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0),
        a=((), (1 / 5,), (3 / 40, 9 / 40), (44 / 45, -56 / 15, 32 / 9),
           (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
           (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
           (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84)),
        b=(35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0),
        b_low=(5179 / 57600, 0.0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100,
               1 / 40),
        order=5, fsal=True),
}
ALIASES = {"adaptive": "bosh3"}


class SolverNames(Sequence[str]):
    """The names of the fixed-grid (``adaptive=False``) or adaptive solvers of ``TABLEAUS``
    (aliases first), read from the table on every use, so an entry added later is in it."""

    def __init__(self, adaptive: bool):
        self.adaptive = adaptive

    def names(self) -> tuple[str, ...]:
        own = tuple(n for n, t in TABLEAUS.items() if (t.b_low is not None) == self.adaptive)
        aliases = tuple(a for a, n in ALIASES.items() if n in own)
        return aliases + own

    def __getitem__(self, i: Any) -> Any:
        return self.names()[i]

    def __len__(self) -> int:
        return len(self.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __add__(self, other: Sequence[str]) -> tuple[str, ...]:
        return self.names() + tuple(other)

    def __radd__(self, other: Sequence[str]) -> tuple[str, ...]:
        return tuple(other) + self.names()

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self.names())

    def __repr__(self) -> str:
        return repr(self.names())


SOLVERS = SolverNames(adaptive=False)  # fixed grid: training and evaluation
ADAPTIVE_SOLVERS = SolverNames(adaptive=True)  # step-size control; adaptive = bosh3
