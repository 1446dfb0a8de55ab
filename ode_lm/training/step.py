"""Loss, train step and eval step: pure functions of (state, batch), jit-ed by the caller.

The step reads in one pass: the main solve (as the objective's terms set it) -> each term's
loss -> microbatch accumulation -> the update. ``TrainStep`` (``jit_train_step``) picks the
compiled variant of each step on the host; ``ode-lm aot`` lowers every variant against
``spec.abstract_state``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ode_lm.config_types import check_types, require, require_at_least, require_one_of
from ode_lm.data.packing import BATCH_KEYS
from ode_lm.models import solvers as solvers_lib
from ode_lm.models.config import SOLVERS
from ode_lm.models.solve import OWN, Solve
from ode_lm.partitioning import batch_sharding, logical_to_mesh
from ode_lm.training import objective as objective_lib
from ode_lm.training.state import StateSpec

log = logging.getLogger("ode_lm.eval")

Batch = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the train step; the recipe is ``terms`` (``objective.Term``s:
    ``StepConfig.terms = [@RandomSteps(), @KineticEnergy()]``; none: the paper's step)."""

    microbatches: int = 1  # gradient accumulation
    num_steps: int | None = None  # ODE steps for training (None = the model's default)
    solver: str | None = None
    terms: tuple = ()
    # Stochastic forward (dropout, random grid offset) with a per-step RNG; None: on when
    # the model config asks for dropout or a random grid offset.
    dropout: bool | None = None

    def __post_init__(self):
        check_types(self)
        require_at_least(self, 1, "microbatches", "num_steps")
        if self.solver is not None:
            require_one_of(self, "solver", SOLVERS)
        require(self, "terms", all(isinstance(t, objective_lib.Term) for t in self.terms),
                f"expected training-objective terms "
                f"({', '.join(t.__name__ for t in objective_lib.TERMS)})")
        require(self, "num_steps", self.num_steps is None or not any(
            isinstance(t, objective_lib.RandomSteps) for t in self.terms),
            "set num_steps or a RandomSteps term, not both")
        object.__setattr__(self, "objective", objective_lib.Objective(self.terms))


def token_loss_sums(
    spec: StateSpec,
    params: Any,
    batch: Batch,
    *,
    solve: Solve = OWN,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token cross-entropy, number of counted tokens) for one batch,
    the model's forward at ``solve`` (``models.solve.Solve``)."""
    return _token_loss(spec, params, batch, solve=solve, dropout_key=dropout_key)[:2]


def _token_loss(spec, params, batch, *, solve, dropout_key):
    """(loss sum, token count, solver stats) — ``token_loss_sums`` plus the NFE."""
    logits, stats = _logits(spec, params, batch, solve=solve, dropout_key=dropout_key)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask), {**stats, "logits": logits}


def _logits(spec, params, batch, *, solve, dropout_key):
    """float32 logits [B, T, V] and the solver stats of one forward."""
    model = spec.model(params)
    rngs = nnx.Rngs(dropout=dropout_key) if dropout_key is not None else None
    # The rules make the model's logical activation constraints (activation_batch, ...)
    # real under the caller's mesh; without them they are no-ops and XLA may replicate
    # activations across the batch shards.
    with nnx.logical_axis_rules(spec.rules):
        logits = model(
            batch["inputs"],
            batch.get("positions"),
            batch.get("segment_ids"),
            solve=solve,
            deterministic=dropout_key is None,
            rngs=rngs,
            return_stats=True,
        )
    logits, stats = logits
    return logits.astype(jnp.float32), stats


def _split_microbatches(batch: Batch, k: int, spec: StateSpec) -> Batch:
    """[B, ...] -> [k, B/k, ...] taking every k-th row, so each microbatch stays balanced
    over the (data, fsdp) shards of the batch dimension."""
    sharding = NamedSharding(spec.mesh, logical_to_mesh((None, "activation_batch"), spec.rules))

    def split(x):
        y = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        spec_tail = (None,) * (y.ndim - 2)
        return jax.lax.with_sharding_constraint(
            y, NamedSharding(spec.mesh, P(*sharding.spec, *spec_tail))
        )

    return {key: split(v) for key, v in batch.items()}


def make_objective_grads(spec: StateSpec, config: StepConfig = StepConfig(),
                         variant: tuple | None = None) -> Callable:
    """(params, batch, step, key) -> (data loss, metrics, gradients) of the objective for one
    ``variant`` (the terms' host draws; default: ``Objective.default_variant``): the main
    solve as the terms set it -> each term's loss -> accumulation over microbatches."""
    k = config.microbatches
    objective = config.objective
    variant = objective.default_variant() if variant is None else tuple(variant)
    chosen = list(zip(objective.terms, variant, strict=True))

    def objective_grads(params, batch: Batch, step: jax.Array, key: jax.Array):
        num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        solve = Solve(config.solver, config.num_steps)
        for term, choice in chosen:  # the step's main solve, as the terms change it
            solve = term.main_solve(solve, choice, key)

        def loss_fn(p, mb, mb_key):
            """(objective, (metrics, data loss)): the data loss alone is the reported loss;
            every term's loss is its own metric."""
            total, stats, logits = _solve_loss(spec, p, mb, solve, mb_key, config.dropout)
            inputs = objective_lib.TermInputs(
                params=p, batch=mb, key=mb_key, step_key=key, step=step, num_tokens=num_tokens,
                microbatches=k, logits=logits, stats=stats,
                solve_batch=functools.partial(_forward, spec, p, config.dropout))
            data_loss = total / num_tokens
            value, metrics = data_loss, dict(stats)
            for term, choice in chosen:
                term_loss, term_metrics = term.loss(inputs, choice)
                value, metrics = value + term_loss, {**metrics, **term_metrics}
            return value, (metrics, data_loss)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if k == 1:
            (_, (metrics, loss)), grads = grad_fn(params, batch, key)
        else:
            micro = _split_microbatches(batch, k, spec)

            def body(carry, xs):
                loss_acc, grad_acc = carry
                mb, i = xs
                (_, (metrics_i, loss_i)), g = grad_fn(params, mb, jax.random.fold_in(key, i))
                return (loss_acc + loss_i, jax.tree.map(jnp.add, grad_acc, g)), metrics_i

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss, grads), metrics = jax.lax.scan(body, (jnp.zeros(()), zeros),
                                                  (micro, jnp.arange(k)))
            metrics = {name: v[0] if name == "nfe" else jnp.mean(v)
                       for name, v in metrics.items()}
        nfe = metrics.pop("nfe")
        # solver steps of this step (N; the layer count for discrete baselines), and the
        # training FLOPs per token of what it ran: the main solve at its N and solver and
        # every further solve a term differentiated (MFU counts them)
        metrics["num_steps"] = _steps_metric(spec, params, solve.num_steps, nfe)
        metrics["flops_per_token"] = _step_flops(spec, params, batch, k, solve, chosen)
        return loss, metrics, grads

    return objective_grads


def make_train_step(
    spec: StateSpec, schedule: optax.Schedule, config: StepConfig = StepConfig(),
    variant: tuple | None = None,
) -> Callable[[dict, Batch], tuple[dict, dict]]:
    """state, batch -> new state, metrics, for one ``variant`` of the objective. A NaN/Inf
    loss or gradient skips the update."""
    objective_grads = make_objective_grads(spec, config, variant)

    def train_step(state: dict, batch: Batch) -> tuple[dict, dict]:
        params, step = state["params"], state["step"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
        loss, term_metrics, grads = objective_grads(params, batch, step, key)
        with jax.named_scope("optimizer"):  # names the update's ops in profiles
            grad_norm = optax.tree.norm(grads)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            updates, new_opt = spec.tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        bad = (~ok).astype(jnp.int32)
        new_state = {
            "step": step + 1,
            "params": keep(new_params, params),
            "opt_state": keep(new_opt, state["opt_state"]),
            "rng": state["rng"],
            "skipped": state["skipped"] + bad,
            "bad_streak": jnp.where(ok, 0, state["bad_streak"] + 1),
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(new_state["params"]),
            "learning_rate": schedule(step),
            "skipped_steps": new_state["skipped"],
            "bad_streak": new_state["bad_streak"],
            "tokens": jnp.sum(batch["loss_mask"]),
            **term_metrics,
        }
        return new_state, metrics

    return train_step


def _forward(spec, params, stochastic, batch, solve, key):
    """float32 logits of a further solve of ``params`` (a term's), its grid offset from
    ``key`` when the forward is stochastic."""
    logits, _ = _logits(spec, params, batch, solve=solve,
                        dropout_key=key if stochastic else None)
    return logits


def _solve_loss(spec, params, mb, solve, mb_key, stochastic):
    """(loss sum, stats: NFE and what the solve integrated, logits) of the step's main
    solve."""
    total, _, stats = _token_loss(spec, params, mb, solve=solve,
                                  dropout_key=mb_key if stochastic else None)
    integrals = {name: stats[name] for name in solve.integrate}
    return total, {"nfe": jnp.asarray(stats["nfe"], jnp.int32), **integrals}, stats["logits"]


def _steps_metric(spec: StateSpec, params: Any, num_steps: Any, nfe: jax.Array) -> jax.Array:
    """N of the step as a float: the drawn/configured N, else the model's default."""
    if num_steps is not None:
        return jnp.asarray(num_steps, jnp.float32)
    cfg = getattr(spec.model(params), "config", None)
    if cfg is not None and cfg.architecture == "ode":
        return jnp.asarray(cfg.num_steps, jnp.float32)
    return jnp.asarray(nfe, jnp.float32)


def _step_flops(spec, params, batch, k, solve, chosen) -> jax.Array:
    """Training FLOPs per token of what this step ran (``models.accounting``, the one count):
    the main solve, and each further solve a term ran and differentiated (its blocks, weight
    generation and head); NaN for a model without a ``ModelConfig``."""
    from ode_lm.models import accounting

    cfg = getattr(spec.model(params), "config", None)
    if cfg is None or not hasattr(cfg, "architecture"):
        return jnp.float32(jnp.nan)
    seq_len = batch["inputs"].shape[1]
    shape = {"seq_len": seq_len, "tokens_per_batch": batch["inputs"].shape[0] * seq_len // k}
    total = accounting.flops_per_token(cfg, solve.num_steps, solver=solve.solver,
                                       **shape).training
    for term, choice in chosen:
        for n, solver, rows in term.extra_forwards(choice):
            total = total + rows * accounting.flops_per_token(cfg, n, solver=solver,
                                                              **shape).training
    return jnp.asarray(total, jnp.float32)


class TrainStep:
    """The train step on the host: each step's variant is drawn from (seed, step) by the
    objective's terms and runs its own compiled program (each compiled once, on first use),
    so a share of costly steps costs only that share."""

    def __init__(self, spec: StateSpec, schedule: optax.Schedule, config: StepConfig,
                 seed: int = 0, *, jit: bool = True):
        self.spec, self.schedule, self.config, self.seed, self.jit = (
            spec, schedule, config, seed, jit)
        self._programs: dict[tuple, Callable] = {}

    def variant(self, step: int) -> tuple:
        return self.config.objective.variant(self.seed, step)

    def variants(self) -> list[tuple]:
        return self.config.objective.variants()

    def program(self, variant: tuple) -> Callable:
        """The (jit-ed) step of one variant, built once."""
        variant = tuple(variant)
        if variant not in self._programs:
            fn = make_train_step(self.spec, self.schedule, self.config, variant)
            self._programs[variant] = _jit(self.spec, fn) if self.jit else fn
        return self._programs[variant]

    def compile_all(self, state: dict, batch: Batch) -> dict[tuple, float]:
        """Every variant the objective can draw, compiled now against this state and batch
        (lowered in turn, compiled concurrently: XLA compiles outside the GIL), so no step
        stalls mid-run on a variant's first draw, on every host of a pod at once. Seconds
        per variant (lowering and compiling)."""
        if not self.jit:
            return {}
        import concurrent.futures
        import time

        lowered = {}
        for variant in self.variants():
            t0 = time.perf_counter()
            lowered[variant] = (self.program(variant).lower(state, batch),
                                time.perf_counter() - t0)

        def compile_one(item):
            variant, (low, lower_s) = item
            t0 = time.perf_counter()
            return variant, low.compile(), lower_s + time.perf_counter() - t0

        workers = max(1, min(len(lowered), 4))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(compile_one, lowered.items()))
        for variant, compiled, _ in done:
            self._programs[variant] = compiled
        return {variant: seconds for variant, _, seconds in done}

    def __call__(self, state: dict, batch: Batch, step: int | None = None):
        """One step; ``step`` (the state's step, known to the loop) saves reading it back."""
        step = int(jax.device_get(state["step"])) if step is None else step
        return self.program(self.variant(step))(state, batch)


def _jit(spec: StateSpec, fn: Callable) -> Callable:
    replicated = NamedSharding(spec.mesh, P())
    return jax.jit(
        fn,
        in_shardings=(spec.shardings, batch_sharding(spec.mesh, spec.rules)),
        out_shardings=(spec.shardings, replicated),
        donate_argnums=0,
    )


def jit_train_step(
    spec: StateSpec, schedule: optax.Schedule, config: StepConfig = StepConfig(), seed: int = 0
) -> TrainStep:
    """The train step with in/out shardings and the state donated, one program per variant."""
    return TrainStep(spec, schedule, config, seed)


def abstract_batch(spec: StateSpec, batch_size: int, seq_len: int, batch_keys=BATCH_KEYS) -> dict:
    """ShapeDtypeStructs of one global batch, for ahead-of-time lowering."""
    sharding = batch_sharding(spec.mesh, spec.rules)
    dtype = lambda k: jnp.float32 if k == "loss_mask" else jnp.int32
    return {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), dtype(k), sharding=sharding)
        for k in batch_keys
    }


def make_eval_step(spec: StateSpec, solve: Solve = OWN):
    """params, batch -> (loss sum, token count, NFE, capped) at ``solve``: exact
    token-weighted sums, no averaging; NFE = vector-field evaluations of the batch's solve
    (adaptive: as chosen by the step-size controller at its rtol/atol; fixed grid:
    N·stages); capped = 1 when an adaptive solve stopped at its step cap short of t1 (fixed
    grid: 0)."""

    def eval_step(params, batch):
        total, count, stats = _token_loss(spec, params, batch, solve=solve, dropout_key=None)
        capped = jnp.asarray(stats.get("capped", False), jnp.float32)
        return total, count, jnp.asarray(stats["nfe"], jnp.float32), capped

    replicated = NamedSharding(spec.mesh, P())
    return jax.jit(
        eval_step,
        in_shardings=(spec.shardings["params"], batch_sharding(spec.mesh, spec.rules)),
        out_shardings=(replicated,) * 4,
    )


@dataclasses.dataclass(frozen=True)
class EvalResult:
    loss: float  # token-weighted mean cross-entropy (nats)
    tokens: float
    nfe: float  # mean vector-field evaluations per batch
    capped: float = 0.0  # fraction of batches whose adaptive solve hit its step cap

    @property
    def perplexity(self) -> float:
        import math

        return math.exp(min(self.loss, 80.0))


def run_eval(eval_step: Callable, params: Any, batches: Any,
             what: str = "the eval pipeline", *, total: int | None = None,
             label: str = "eval") -> EvalResult:
    """The one token-weighted eval loop (trainer, ``ode_lm.commands.eval``, the depth report).

    With ``total`` (batches expected) long passes show ``metrics.Progress``'s line with an
    ETA, also while the first batch runs (a compile, a large N); any batch whose adaptive
    solve hit the step cap is reported in one warning line."""
    from ode_lm.training.metrics import Progress

    progress = Progress(label, total, unit="batches", heartbeat=True)
    loss, tokens, nfe, capped, count = 0.0, 0.0, 0.0, 0.0, 0
    try:
        for batch in batches:
            s, n, e, c = eval_step(params, batch)
            loss, tokens, nfe = loss + float(s), tokens + float(n), nfe + float(e)
            capped, count = capped + float(c), count + 1
            progress.update(count)
    finally:
        progress.close()
    progress.done()
    if tokens == 0:
        raise ValueError(f"{what} produced no counted tokens")
    if capped:
        log.warning("%s: the adaptive solver hit its step cap (%d) on %d of %d batches "
                    "(%.0f%%): their loss is of an unfinished solve; loosen rtol/atol",
                    label, solvers_lib.ADAPTIVE_MAX_STEPS, capped, count, 100 * capped / count)
    return EvalResult(loss=loss / tokens, tokens=tokens, nfe=nfe / count,
                      capped=capped / count)
