"""The training objective as composable terms: one small object per recipe ingredient.

A term owns three things: its per-step draw (``choose``: on the host, a pure function of the
run's seed and the step, so resume is exact), what that draw changes in the step's main solve
(``main_solve``) and the loss term it adds, with its metrics (``loss``). A draw that changes
the computation (a shared-solver step, a distillation step) picks one of the compiled step
variants (``Objective.variants``): nothing is computed and then thrown away. Draws that only
change values (the N of a step, the grid offset) stay inside the program, from the state's
key. A recipe file (``configs/recipes/``) lists terms: ``StepConfig.terms = [@KineticEnergy(),
...]``; the paper's recipe has none.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ode_lm.config_types import (
    check_types,
    require,
    require_at_least,
    require_one_of,
    require_positive,
)
from ode_lm.errors import SettingError
from ode_lm.models.config import SOLVERS
from ode_lm.models.solve import Solve


@dataclasses.dataclass(frozen=True)
class TermInputs:
    """What a term's loss sees, for one microbatch: the main solve's float32 logits and
    stats, the global count of counted tokens (losses are sums over it, so microbatches add
    up), and ``forward`` for a further solve of the same parameters; ``every_kth_row`` is
    the same on a slice of the rows (a further solve at a fraction of its cost)."""

    params: Any
    batch: Any
    key: jax.Array  # this microbatch's key
    step_key: jax.Array  # the step's key (draws made once per step)
    step: jax.Array  # the step being taken (traced)
    num_tokens: jax.Array
    microbatches: int
    logits: jax.Array
    stats: dict
    solve_batch: Any  # (batch, solve, key) -> float32 logits

    def mask(self) -> jax.Array:
        return self.batch["loss_mask"].astype(jnp.float32)

    def forward(self, solve: Solve, key: jax.Array) -> jax.Array:
        """float32 logits of a further solve of this microbatch (its grid offset from key)."""
        return self.solve_batch(self.batch, solve, key)

    def every_kth_row(self, k: int, owner: str) -> TermInputs:
        """These inputs on rows 0, k, 2k, … of the microbatch, with the token count scaled
        by 1/k, so a loss summed over them estimates the whole microbatch's. Strided, so a
        batch shard whose row count divides by k keeps its own rows. ``owner``: the setting
        named when the microbatch's rows do not divide by k."""
        if k == 1:
            return self
        rows = self.logits.shape[0]
        if rows % k:
            raise SettingError(f"{owner}={k}: the microbatch has {rows} rows, not a "
                               f"multiple of {k}")

        def pick(x):
            return x.reshape(rows // k, k, *x.shape[1:])[:, 0]

        return dataclasses.replace(self, batch={n: pick(v) for n, v in self.batch.items()},
                                   logits=pick(self.logits), num_tokens=self.num_tokens / k)


Choice = Hashable
BLOCK_STREAM = 0x424C4B53  # the order of a block's strata ("BLKS")


class Term:
    """One ingredient of the objective; the base draws nothing and adds nothing."""

    name: ClassVar[str] = "term"
    block_steps = 1  # a term with a drawn share may set it per instance (a dataclass field)

    def variants(self) -> tuple[Choice, ...]:
        """Every value ``choose`` can return: one compiled variant each."""
        return (None,)

    def choose(self, seed: int, step: int) -> Choice:
        """This step's host-side draw (a pure function of seed and step)."""
        return None

    def main_solve(self, solve: Solve, choice: Choice, key: jax.Array) -> Solve:
        """The main solve (the one trained on the data; ``models.solve.Solve``) as this term
        changes it (``key``: the step's key)."""
        return solve

    def loss(self, inputs: TermInputs, choice: Choice) -> tuple[jax.Array, dict]:
        """(objective term, metrics) of one microbatch; metrics are averaged over them."""
        return jnp.zeros(()), {}

    def extra_forwards(self, choice: Choice) -> tuple[tuple[Any, str | None, float], ...]:
        """(N, solver, share of the rows) of each further solve ``loss`` runs and
        differentiates: its FLOPs."""
        return ()

    def _uniform(self, seed: int, step: int) -> float:
        """A float in [0, 1) from (seed, this term's name, step): the host draw.

        With ``block_steps = k > 1`` the draws are stratified over each block of k steps:
        the block's k floats fall one in each of [0, 1/k), [1/k, 2/k), ... in an order drawn
        from (seed, block). Each is still uniform, so a step is drawn with probability
        ``share``, but a block holds share·k drawn steps (rounded either way) rather than a
        binomial count: no stretch of training goes without its share."""
        stream = zlib.crc32(self.name.encode())
        seq = np.random.SeedSequence([seed % 2**32, stream, step])
        jitter = float(np.random.default_rng(seq).random())
        k = self.block_steps
        if k == 1:
            return jitter
        block, position = divmod(step, k)
        order = np.random.SeedSequence([seed % 2**32, stream, block, BLOCK_STREAM])
        stratum = int(np.random.default_rng(order).permutation(k)[position])
        return (stratum + jitter) / k


def draw(key: jax.Array, choices: Sequence[int], weights: Sequence[float] = ()) -> jax.Array:
    """One entry of ``choices`` as a traced int32, uniform or by relative ``weights``."""
    if weights:
        logits = jnp.log(jnp.asarray(weights, jnp.float32) / sum(weights))
        pick = jax.random.categorical(key, logits)
    else:
        pick = jax.random.randint(key, (), 0, len(choices))
    return jnp.asarray(choices, jnp.int32)[pick]


def _positive_ints(config: Any, field: str) -> None:
    values = getattr(config, field)
    require(config, field, bool(values) and all(n >= 1 for n in values),
            "expected a non-empty tuple of positive ints")


def _share(config: Any) -> None:
    require(config, "share", 0 < config.share <= 1, "must be in (0, 1]")


def _kl_from_main(inputs: TermInputs, student: jax.Array) -> jax.Array:
    """KL(stop_gradient(p_main) ‖ p_student) per counted token, a share of the global count."""
    log_t = jax.nn.log_softmax(jax.lax.stop_gradient(inputs.logits))
    kl = jnp.sum(jnp.exp(log_t) * (log_t - jax.nn.log_softmax(student)), axis=-1)
    return jnp.sum(kl * inputs.mask()) / inputs.num_tokens


# fold_in ids of the in-program draws, apart from the microbatch indices 0..k-1
NUM_STEPS_STREAM = 0x4E535445  # the step's N ("NSTE")
DISTILL_STREAM = 0x44495354  # the coarse N and the coarse solve's grid offset ("DIST")


@dataclasses.dataclass(frozen=True)
class RandomSteps(Term):
    """A random N per step from ``choices`` (by ``weights``, uniform when empty): with the
    model's random grid offset no single grid can be memorised. Drawn in the program from
    the state's key; the solve scans max(choices) steps and skips those past N."""

    choices: tuple[int, ...] = (4, 5, 6, 7, 8)
    weights: tuple[float, ...] = ()
    name: ClassVar[str] = "random_steps"

    def __post_init__(self):
        check_types(self)
        _positive_ints(self, "choices")
        w = self.weights
        require(self, "weights", not w or (len(w) == len(self.choices)
                                           and all(x >= 0 for x in w) and sum(w) > 0),
                f"expected one weight >= 0 per choice {self.choices!r}, not all zero")

    def main_solve(self, solve, choice, key):
        n = draw(jax.random.fold_in(key, NUM_STEPS_STREAM), self.choices, self.weights)
        return dataclasses.replace(solve, num_steps=n, max_steps=max(self.choices))


@dataclasses.dataclass(frozen=True)
class KineticEnergy(Term):
    """λ·∫ mean‖f(x, t)‖² dt (Finlay et al. 2020): straighter trajectories that any solver
    integrates alike. λ is ``weight``, or with ``final`` a linear ramp from ``weight`` at
    step 0 to ``final`` at ``ramp_steps``, then held (logged as kinetic_energy_weight)."""

    weight: float = 2.0
    final: float | None = None
    ramp_steps: int = 0
    name: ClassVar[str] = "kinetic_energy"

    def __post_init__(self):
        check_types(self)
        require_at_least(self, 0.0, "weight", "final")
        require_at_least(self, 0, "ramp_steps")
        require(self, "ramp_steps", self.final is None or self.ramp_steps >= 1,
                "must be >= 1 when KineticEnergy.final is set")

    def weight_at(self, step: jax.Array) -> jax.Array:
        w0 = jnp.float32(self.weight)
        if self.final is None:
            return w0
        frac = jnp.minimum(step.astype(jnp.float32) / self.ramp_steps, 1.0)
        return w0 + (jnp.float32(self.final) - w0) * frac

    def main_solve(self, solve, choice, key):
        return solve.replace(integrate=(*solve.integrate, "kinetic_energy"))

    def loss(self, inputs, choice):  # a discrete model refuses the solve (no integral)
        w = self.weight_at(inputs.step)
        energy = inputs.stats["kinetic_energy"]
        metrics = {"kinetic_energy": energy}
        if self.final is not None:
            metrics["kinetic_energy_weight"] = w
        return w * energy / inputs.microbatches, metrics


@dataclasses.dataclass(frozen=True)
class Distillation(Term):
    """Self-distillation across grids: a coarse Euler solve (N drawn in the program from
    ``num_steps``) learns the main solve's next-token distribution,
    ``weight``·KL(stop_gradient(p_main) ‖ p_coarse) per token, on a drawn ``share`` of the
    steps (the others compile without the coarse solve)."""

    weight: float = 1.0
    num_steps: tuple[int, ...] = (2, 3)
    share: float = 1.0
    row_stride: int = 1  # the coarse solve runs on every k-th row: 1/k of its cost
    block_steps: int = 1  # > 1: the share drawn evenly over blocks of this many steps
    name: ClassVar[str] = "distillation"

    def __post_init__(self):
        check_types(self)
        _positive_ints(self, "num_steps")
        require_positive(self, "weight")
        _share(self)
        require_at_least(self, 1, "row_stride", "block_steps")

    def variants(self):
        return (True,) if self.share >= 1 else (False, True)

    def choose(self, seed, step):
        return self.share >= 1 or self._uniform(seed, step) < self.share

    def loss(self, inputs, choice):
        if not choice:
            return jnp.zeros(()), {}
        key = jax.random.fold_in(inputs.key, DISTILL_STREAM)
        # the coarse N: from the step's stream, as the main N (one per step)
        coarse_n = draw(jax.random.fold_in(inputs.step_key, DISTILL_STREAM), self.num_steps)
        rows = inputs.every_kth_row(self.row_stride, "Distillation.row_stride")
        kl = _kl_from_main(rows, rows.forward(
            Solve("euler", coarse_n, max_steps=max(self.num_steps)), key))
        return self.weight * kl, {"distill_loss": kl * inputs.microbatches,
                                  "distill_num_steps": coarse_n.astype(jnp.float32)}

    def extra_forwards(self, choice):
        mean_n = sum(self.num_steps) / len(self.num_steps)
        return ((mean_n, "euler", 1 / self.row_stride),) if choice else ()


@dataclasses.dataclass(frozen=True)
class SolverShare(Term):
    """On a drawn ``share`` of the steps the main solve is ``solver`` at ``num_steps``
    instead of the step's own: the exact flow (what RK4 and the adaptive solver compute)
    is trained too, not only Euler's grid. With ``final`` the share ramps linearly from
    ``share`` at step 0 to ``final`` at ``ramp_steps``, then holds: the exact flow drifts
    from Euler's grid as training goes on, so early steps can spend less on it."""

    share: float = 0.25
    solver: str = "rk4"
    num_steps: int = 2
    final: float | None = None
    ramp_steps: int = 0
    block_steps: int = 1  # > 1: the share drawn evenly over blocks of this many steps
    name: ClassVar[str] = "solver_share"

    def __post_init__(self):
        check_types(self)
        _share(self)
        require(self, "final", self.final is None or 0 < self.final <= 1, "must be in (0, 1]")
        require_at_least(self, 0, "ramp_steps")
        require(self, "ramp_steps", self.final is None or self.ramp_steps >= 1,
                "must be >= 1 when SolverShare.final is set")
        require_one_of(self, "solver", SOLVERS)
        require_at_least(self, 1, "num_steps", "block_steps")

    def share_at(self, step: int) -> float:
        """The share of steps drawn at ``step`` (host side)."""
        if self.final is None:
            return self.share
        return self.share + (self.final - self.share) * min(step / self.ramp_steps, 1.0)

    def variants(self):
        return (True,) if min(self.share, self.final or 1.0) >= 1 else (False, True)

    def choose(self, seed, step):
        share = self.share_at(step)
        return share >= 1 or self._uniform(seed, step) < share

    def main_solve(self, solve, choice, key):
        if not choice:
            return solve
        return dataclasses.replace(solve, num_steps=self.num_steps, solver=self.solver,
                                   max_steps=None)

    def loss(self, inputs, choice):
        return jnp.zeros(()), {"solver_share": jnp.float32(bool(choice))}


@dataclasses.dataclass(frozen=True)
class _SecondSolve(Term):
    """On a drawn ``share`` of the steps, a second solve of the same batch with ``solver``
    at ``num_steps`` adds ``weight``·(its loss); the main solve keeps every step."""

    weight: float = 1.0
    share: float = 0.1
    solver: str = "rk4"
    num_steps: int = 2
    row_stride: int = 1  # the second solve runs on every k-th row: 1/k of its cost
    block_steps: int = 1  # > 1: the share drawn evenly over blocks of this many steps

    def __post_init__(self):
        check_types(self)
        require_positive(self, "weight")
        _share(self)
        require_one_of(self, "solver", SOLVERS)
        require_at_least(self, 1, "num_steps", "row_stride", "block_steps")

    def variants(self):
        return (False, True) if self.share < 1 else (True,)

    def choose(self, seed, step):
        return self.share >= 1 or self._uniform(seed, step) < self.share

    def extra_forwards(self, choice):
        return ((self.num_steps, self.solver, 1 / self.row_stride),) if choice else ()

    def _rows(self, inputs: TermInputs) -> TermInputs:
        return inputs.every_kth_row(self.row_stride, f"{type(self).__name__}.row_stride")

    def _second_solve(self, inputs: TermInputs, stream: int) -> jax.Array:
        """The second solve's logits on ``inputs`` (those of ``_rows``)."""
        key = jax.random.fold_in(inputs.key, stream)
        return inputs.forward(Solve(self.solver, self.num_steps), key)


SOLVER_DISTILL_STREAM = 0x53444953  # the exact solve's grid offset ("SDIS")


@dataclasses.dataclass(frozen=True)
class SolverDistillation(_SecondSolve):
    """The second solve (a cheap stand-in for the exact flow) learns the main solve's
    next-token distribution, ``weight``·KL(stop_gradient(p_main) ‖ p_solver): the exact flow
    is pulled to Euler's grid, not Euler's grid to the exact flow."""

    share: float = 0.15
    name: ClassVar[str] = "solver_distillation"

    def loss(self, inputs, choice):
        if not choice:
            return jnp.zeros(()), {}
        rows = self._rows(inputs)
        kl = _kl_from_main(rows, self._second_solve(rows, SOLVER_DISTILL_STREAM))
        return self.weight * kl, {"solver_distill_loss": kl * inputs.microbatches}


TERMS: tuple[type[Term], ...] = (RandomSteps, KineticEnergy, Distillation, SolverShare,
                                 SolverDistillation)


@dataclasses.dataclass(frozen=True)
class Objective:
    """The data loss of the main solve plus each term's, and the variants they can draw."""

    terms: tuple[Term, ...] = ()

    def __post_init__(self):
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise SettingError(f"StepConfig.terms={names}: each term at most once")

    def variant(self, seed: int, step: int) -> tuple[Choice, ...]:
        """This step's compiled variant: every term's host draw."""
        return tuple(t.choose(seed, step) for t in self.terms)

    def variants(self) -> list[tuple[Choice, ...]]:
        """Every variant the terms can draw (what ``ode-lm aot`` compiles)."""
        return list(itertools.product(*(t.variants() for t in self.terms)))

    def default_variant(self) -> tuple[Choice, ...]:
        """The costliest-looking variant (each term's last choice), for one-off lowering."""
        return tuple(t.variants()[-1] for t in self.terms)
