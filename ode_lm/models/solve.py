"""A solve: how one forward integrates dx/dt = f(x, t) on [0, 1], as one frozen value.

Every caller that runs, names or reads a solve uses ``Solve``: the model's forward
(``model(tokens, solve=...)``), the train step's main solve and the terms' further solves,
the eval settings (``TrainConfig.eval_solves``, ``ode-lm eval --solves``), the eval figures'
names (``training.metric_names``) and the depth tables. A field left ``None`` is the model's
own (``ModelConfig.solver``, ``num_steps``, ``rtol``, ``atol``).

The text form is one parser (``Solve.parse``, ``parse_solves`` for a list) and one printer
(``str(solve)``, ``Solve.words``): ``'rk4:steps=8'`` (a fixed-grid solver at N steps),
``'adaptive:rtol=1e-3'`` (an adaptive solver at a relative tolerance), ``'steps=8'`` (the
model's own solver at 8 steps); ``'rk4:8'``, ``'adaptive:1e-3'`` and ``'8'`` are short for
the same. The text names the solver and N or rtol; the rest (atol, the step cap of a traced
N, the grid offset, what is integrated alongside) is set in code. No jax here: the commands
that only read metrics files stay light.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ode_lm.models.config import ADAPTIVE_SOLVERS, SOLVERS

SOLVE_FORMS = "'<solver>:steps=<N>', '<adaptive solver>:rtol=<r>' or 'steps=<N>'"
# integrated beside x by a fixed-grid solve at no extra evaluation, when a term asks:
# the kinetic energy ∫ mean‖f(x, t)‖² dt
INTEGRALS = ("kinetic_energy",)


def is_adaptive(solver: str | None) -> bool:
    return solver is not None and solver in ADAPTIVE_SOLVERS


@dataclasses.dataclass(frozen=True)
class Solve:
    """How one forward solves the ODE; ``None`` fields are the model's own.

    ``num_steps``: N (an int, or a traced int32 bounded by the static ``max_steps``, the
    step cap the scan runs to: random step counts in training, one program for every N);
    ``rtol``/``atol``: an adaptive solver's tolerances; ``grid_offset``: the random grid
    offset of a training solve (None: ``ModelConfig.random_grid_offset``); ``integrate``:
    what the solve also integrates (``INTEGRALS``)."""

    solver: str | None = None
    num_steps: Any = None
    rtol: float | None = None
    atol: float | None = None
    max_steps: int | None = None
    grid_offset: bool | None = None
    integrate: tuple[str, ...] = ()

    def __post_init__(self):
        if self.solver is not None and self.solver not in SOLVERS + ADAPTIVE_SOLVERS:
            raise ValueError(f"Solve.solver={self.solver!r}: expected one of "
                             f"{SOLVERS + ADAPTIVE_SOLVERS}")
        if isinstance(self.num_steps, int) and self.num_steps < 1:
            raise ValueError(f"Solve.num_steps={self.num_steps}: must be >= 1")
        for field in ("rtol", "atol"):
            value = getattr(self, field)
            if value is not None and not (value > 0 or (field == "atol" and value == 0)):
                raise ValueError(f"Solve.{field}={value!r}: must be > 0")
        unknown = [i for i in self.integrate if i not in INTEGRALS]
        if unknown:
            raise ValueError(f"Solve.integrate={self.integrate!r}: expected names from "
                             f"{INTEGRALS}")

    @property
    def adaptive(self) -> bool:
        return is_adaptive(self.solver)

    @property
    def words(self) -> str:
        """The printer: ``'rk4:steps=8'``, ``'adaptive:rtol=0.001'``, ``'steps=8'``, or
        ``''`` at the model's own solver and N (what an eval figure writes after ``@``)."""
        if self.adaptive:
            return f"{self.solver}:rtol={self.rtol:g}"
        if self.num_steps is None:
            return ""
        return f"steps={self.num_steps}" if self.solver is None else \
            f"{self.solver}:steps={self.num_steps}"

    @property
    def suffix(self) -> str:
        """``'@' + words``, or ``''`` at the model's own solver and N."""
        return f"@{self.words}" if self.words else ""

    def __str__(self) -> str:
        return self.words

    @classmethod
    def of(cls, num_steps: int | None = None, solver: str | None = None,
           rtol: float | None = None, atol: float | None = None) -> Solve:
        """The solve a command's flags describe: N for a fixed-grid solver (or the model's
        own), rtol/atol for an adaptive one (``cli.check_solver_flags`` refuses the flags
        the solver has no use for before this is built)."""
        if is_adaptive(solver):
            return cls(solver, rtol=rtol, atol=atol)
        return cls(solver, num_steps)

    def replace(self, **changes) -> Solve:
        return dataclasses.replace(self, **changes)

    def changes(self) -> dict[str, Any]:
        """The fields set away from the model's own (what a discrete model cannot run; a
        grid offset turned off is no change)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        unset = lambda v: v is None or v is False or (isinstance(v, tuple) and not v)
        return {k: v for k, v in values.items() if not unset(v)}

    def describe(self) -> str:
        """``'rk4:steps=8'`` or, beyond what the text says, ``Solve(integrate=...)``."""
        extra = {k: v for k, v in self.changes().items()
                 if k not in ("solver", "num_steps", "rtol")}
        if self.words and not extra:
            return repr(self.words)
        return "Solve(" + ", ".join(f"{k}={v!r}" for k, v in self.changes().items()) + ")"

    @classmethod
    def parse(cls, text: str, what: str = "solve") -> Solve:
        """The parser: the module's text forms → ``Solve``; a bad one is one ``ValueError``
        line ``{what}={text!r}: why``."""
        try:
            return _parse(text)
        except ValueError as e:
            raise ValueError(f"{what}={text!r}: {e}") from None

    def resolved(self, solver: str, num_steps: int | None, rtol: float | None = None,
                 atol: float | None = None) -> Solve:
        """The absolute solve: the model's ``solver`` and N (fixed grid) or tolerances
        (adaptive) where this one leaves them ``None``."""
        own = self.solver or solver
        if is_adaptive(own):
            return Solve(own, rtol=rtol if self.rtol is None else self.rtol,
                         atol=atol if self.atol is None else self.atol)
        return Solve(own, num_steps if self.num_steps is None else self.num_steps)

    def relative(self, solver: str | None, num_steps: int | None) -> Solve:
        """This (absolute) solve as a name writes it against the model's own ``solver`` and
        N: ``Solve()`` at both, ``Solve(None, M)`` its solver at another M, ``Solve(s, M)``
        another fixed-grid solver, ``Solve(s, rtol=r)`` an adaptive one."""
        if self.adaptive:
            return Solve(self.solver, rtol=self.rtol)
        n = num_steps if self.num_steps is None else self.num_steps
        if self.solver is None or self.solver == solver:
            return Solve() if n == num_steps else Solve(None, n)
        return Solve(self.solver, n)


def _parse(text: str) -> Solve:
    """The grammar: ``[<solver>:][steps=|rtol=]<value>``; the bare value is the solver's own
    key (N for a fixed grid, rtol for an adaptive solver)."""
    solver, _, setting = text.rpartition(":")
    if solver and solver not in SOLVERS + ADAPTIVE_SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {SOLVERS + ADAPTIVE_SOLVERS}")
    adaptive = is_adaptive(solver)
    want = "rtol" if adaptive else "steps"
    key, eq, value = setting.rpartition("=")
    if (eq and key != want) or (not eq and key) or not value.strip():
        raise ValueError(f"expected {SOLVE_FORMS}")
    try:
        number = float(value) if adaptive else int(value)
    except ValueError:
        kind = "a tolerance" if adaptive else "a whole number of steps"
        raise ValueError(f"{value!r} is not {kind}") from None
    if not number > 0:
        raise ValueError(f"{want} must be > 0")
    return Solve(solver, rtol=number) if adaptive else Solve(solver or None, number)


def parse_solves(text: str, what: str = "solves") -> list[Solve]:
    """Space-separated groups, each ``[<solver>:]<value>[,<value>...]`` (``'euler:4,6,8
    rk4:steps=8 adaptive:1e-3 12'``), each value read by ``Solve.parse``'s grammar, in the
    order given. A bad group is one ``ValueError`` line ``{what}={text!r}: {group!r}: why``."""
    solves = []
    for group in text.split():
        solver, colon, values = group.rpartition(":")
        for item in values.split(","):
            try:
                solves.append(_parse(f"{solver}{colon}{item}"))
            except ValueError as e:
                raise ValueError(f"{what}={text!r}: {group!r}: {e}") from None
    if not solves:
        raise ValueError(f"{what}={text!r}: expected e.g. \"euler:4,6,8 rk4:8 adaptive:1e-3\"")
    return solves


OWN = Solve()  # the model's own solve: its solver at its N (adaptive: its tolerances)
