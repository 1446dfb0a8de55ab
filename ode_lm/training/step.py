"""Loss, train step and eval step: pure functions of (state, batch), jit-ed by the caller.

``make_train_step(spec, ...)`` and ``jit_train_step(spec, ...)`` are what the trainer and
``ode-lm aot`` use; the latter lowers it against ``spec.abstract_state``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ode_lm.config_types import check_types
from ode_lm.data.packing import BATCH_KEYS
from ode_lm.models import solvers as solvers_lib
from ode_lm.partitioning import batch_sharding, logical_to_mesh
from ode_lm.training.state import StateSpec

log = logging.getLogger("ode_lm.eval")

Batch = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the train step."""

    microbatches: int = 1  # gradient accumulation
    num_steps: int | None = None  # ODE steps for training (None = the model's default)
    # Depth-robust training: each step draws its N uniformly from this set (seeded by the
    # state's rng and the step, so resume is exact). One compiled program serves all N: the
    # solve scans max(set) steps and skips those past N (memory as for max(set) steps).
    num_steps_choices: tuple[int, ...] = ()
    solver: str | None = None
    # Kinetic-energy regulariser λ·∫ mean‖f(x, t)‖² dt ("How to train your Neural ODE",
    # Finlay et al. 2020): straighter trajectories that any solver integrates alike.
    kinetic_energy_weight: float = 0.0
    # A kinetic-energy weight that grows with training (None = constant): linear from
    # kinetic_energy_weight at step 0 to this at kinetic_energy_ramp_steps, then held; a
    # function of the step alone, so resume stays exact. Against the depth gap that opens
    # as a long run bends its trajectories again (docs/depth.md).
    kinetic_energy_weight_final: float | None = None
    kinetic_energy_ramp_steps: int = 0
    # Relative weights of num_steps_choices (() = uniform), e.g. more weight on small N for
    # a model that also holds at the cheap end (docs/depth.md).
    num_steps_weights: tuple[float, ...] = ()
    # Self-distillation across grids: in the same step a coarse solve, its N drawn uniformly
    # from distill_num_steps_choices, learns the main (fine) solve's next-token
    # distribution: distill_weight · KL(stop_gradient(p_fine) ‖ p_coarse) per token.
    distill_weight: float = 0.0
    distill_num_steps_choices: tuple[int, ...] = ()
    # Solver-aware training: this share of steps (drawn per step) solves with share_solver
    # at share_num_steps instead of the drawn N and the step's solver, so the exact flow
    # (what RK4 and the adaptive solver compute) is trained too, not only Euler's.
    solver_share: float = 0.0
    share_solver: str = "rk4"
    share_num_steps: int = 2
    # Stochastic forward (dropout, random grid offset) with a per-step RNG; None: on when
    # the model config asks for dropout or a random grid offset.
    dropout: bool | None = None

    def __post_init__(self):
        check_types(self)
        if self.microbatches < 1:
            raise ValueError(f"StepConfig.microbatches={self.microbatches}: must be >= 1")
        choices = tuple(self.num_steps_choices)
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in choices):
            raise ValueError(f"StepConfig.num_steps_choices={self.num_steps_choices!r}: "
                             "expected positive ints")
        if not self.kinetic_energy_weight >= 0:
            raise ValueError(f"StepConfig.kinetic_energy_weight={self.kinetic_energy_weight}:"
                             " must be >= 0")
        final = self.kinetic_energy_weight_final
        if final is not None and (not final >= 0 or self.kinetic_energy_ramp_steps < 1):
            raise ValueError(f"StepConfig.kinetic_energy_weight_final={final}: must be >= 0, "
                             "with kinetic_energy_ramp_steps >= 1 "
                             f"(got {self.kinetic_energy_ramp_steps})")
        if choices and self.num_steps is not None:
            raise ValueError("StepConfig: set num_steps or num_steps_choices, not both")
        object.__setattr__(self, "num_steps_choices", choices)
        weights = self.num_steps_weights
        if weights and (len(weights) != len(choices) or not all(w >= 0 for w in weights)
                        or not sum(weights) > 0):
            raise ValueError(f"StepConfig.num_steps_weights={weights!r}: expected one weight "
                             f">= 0 per num_steps_choices entry {choices!r}, not all zero")
        coarse = self.distill_num_steps_choices
        if any(isinstance(n, bool) or n < 1 for n in coarse):
            raise ValueError(f"StepConfig.distill_num_steps_choices={coarse!r}: "
                             "expected positive ints")
        if not self.distill_weight >= 0 or (self.distill_weight > 0) != bool(coarse):
            raise ValueError(f"StepConfig.distill_weight={self.distill_weight}: must be >= 0, "
                             "and > 0 exactly when distill_num_steps_choices is set")
        if not 0 <= self.solver_share <= 1:
            raise ValueError(f"StepConfig.solver_share={self.solver_share}: must be in [0, 1]")
        if self.solver_share > 0:
            solvers_lib.check_solver(self.share_solver)
            if self.share_num_steps < 1:
                raise ValueError(f"StepConfig.share_num_steps={self.share_num_steps}: "
                                 "must be >= 1")


def token_loss_sums(
    spec: StateSpec,
    params: Any,
    batch: Batch,
    *,
    num_steps: int | None = None,
    solver: str | None = None,
    dropout_key: jax.Array | None = None,
    **solve_options,
) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token cross-entropy, number of counted tokens) for one batch.

    ``solve_options`` go to the model's forward (``max_steps`` for a traced ``num_steps``,
    ``rtol``/``atol`` for an adaptive solver)."""
    return _token_loss(spec, params, batch, num_steps=num_steps, solver=solver,
                       dropout_key=dropout_key, **solve_options)[:2]


def _token_loss(spec, params, batch, *, num_steps, solver, dropout_key, **solve_options):
    """(loss sum, token count, solver stats) — ``token_loss_sums`` plus the NFE."""
    logits, stats = _logits(spec, params, batch, num_steps=num_steps, solver=solver,
                            dropout_key=dropout_key, **solve_options)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask), {**stats, "logits": logits}


def _logits(spec, params, batch, *, num_steps, solver, dropout_key, **solve_options):
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
            num_steps=num_steps,
            solver=solver,
            deterministic=dropout_key is None,
            rngs=rngs,
            return_stats=True,
            **solve_options,
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


def make_train_step(
    spec: StateSpec, schedule: optax.Schedule, config: StepConfig = StepConfig()
) -> Callable[[dict, Batch], tuple[dict, dict]]:
    """state, batch -> new state, metrics. A NaN/Inf loss or gradient skips the update."""
    k = config.microbatches
    choices = config.num_steps_choices

    def train_step(state: dict, batch: Batch) -> tuple[dict, dict]:
        params = state["params"]
        step = state["step"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
        num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        if choices:  # this step's N, from its own stream (microbatch keys fold in 0..k-1)
            num_steps = _draw(jax.random.fold_in(key, _NUM_STEPS_STREAM), choices,
                              config.num_steps_weights)
            solve_options = {"max_steps": max(choices)}
        else:
            num_steps, solve_options = config.num_steps, {}
        draws = _recipe_draws(key, config)
        ke_weight = kinetic_energy_weight(config, step)

        def loss_fn(p, mb, mb_key):
            """(objective, (stats, data loss)): the data loss alone is the reported loss;
            the regularisers are their own metrics."""
            total, stats = _main_loss(spec, p, mb, mb_key, config, num_steps, solve_options,
                                      draws)
            logits = stats.pop("logits")
            data_loss = total / num_tokens
            objective = data_loss + ke_weight * stats["kinetic_energy"] / k
            if config.distill_weight > 0:
                kl = _distill_loss(spec, p, mb, config, draws["coarse"],
                                   jax.random.fold_in(mb_key, _DISTILL_STREAM),
                                   jax.lax.stop_gradient(logits)) / num_tokens
                objective = objective + config.distill_weight * kl
                stats = {**stats, "distill_loss": kl * k}  # per token, like the loss
            return objective, (stats, data_loss)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if k == 1:
            (_, (stats, loss)), grads = grad_fn(params, batch, key)
        else:
            micro = _split_microbatches(batch, k, spec)

            def body(carry, xs):
                loss_acc, grad_acc = carry
                mb, i = xs
                (_, (stats_i, loss_i)), g = grad_fn(params, mb, jax.random.fold_in(key, i))
                return (loss_acc + loss_i, jax.tree.map(jnp.add, grad_acc, g)), stats_i

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss, grads), stats = jax.lax.scan(body, (jnp.zeros(()), zeros),
                                                (micro, jnp.arange(k)))
            stats = {name: v[0] if name == "nfe" else jnp.mean(v) for name, v in stats.items()}

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
        step_n = _steps_metric(spec, params, num_steps, config.solver, stats)
        if config.solver_share > 0:  # a shared-solver step reports its own N
            step_n = jnp.where(draws["share"], float(config.share_num_steps), step_n)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(new_state["params"]),
            "learning_rate": schedule(step),
            "skipped_steps": new_state["skipped"],
            "bad_streak": new_state["bad_streak"],
            "tokens": jnp.sum(batch["loss_mask"]),
            # solver steps of this step (N; the layer count for discrete baselines), as
            # vector-field evaluations / stages
            "num_steps": step_n,
            "kinetic_energy": stats["kinetic_energy"],
        }
        if config.kinetic_energy_weight_final is not None:
            metrics["kinetic_energy_weight"] = ke_weight
        if config.distill_weight > 0:
            metrics["distill_loss"] = stats["distill_loss"]
            metrics["distill_num_steps"] = jnp.asarray(draws["coarse"], jnp.float32)
        if config.solver_share > 0:
            metrics["solver_share"] = draws["share"].astype(jnp.float32)
        return new_state, metrics

    return train_step


def kinetic_energy_weight(config: StepConfig, step: jax.Array) -> jax.Array:
    """λ at ``step``: constant, or the linear ramp to ``kinetic_energy_weight_final``."""
    w0 = jnp.float32(config.kinetic_energy_weight)
    if config.kinetic_energy_weight_final is None:
        return w0
    frac = jnp.minimum(step.astype(jnp.float32) / config.kinetic_energy_ramp_steps, 1.0)
    return w0 + (jnp.float32(config.kinetic_energy_weight_final) - w0) * frac


def _draw(key: jax.Array, choices: tuple[int, ...], weights: tuple[float, ...] = ()):
    """One entry of ``choices`` as a traced int32, uniform or by relative ``weights``."""
    if weights:
        logits = jnp.log(jnp.asarray(weights, jnp.float32) / sum(weights))
        pick = jax.random.categorical(key, logits)
    else:
        pick = jax.random.randint(key, (), 0, len(choices))
    return jnp.asarray(choices, jnp.int32)[pick]


def _recipe_draws(key: jax.Array, config: StepConfig) -> dict:
    """The step's coarse N (self-distillation) and whether it is a shared-solver step, each
    from its own stream of the step's key, so resume stays exact."""
    draws = {}
    if config.distill_weight > 0:
        draws["coarse"] = _draw(jax.random.fold_in(key, _DISTILL_STREAM),
                                config.distill_num_steps_choices)
    if config.solver_share > 0:
        draws["share"] = jax.random.bernoulli(jax.random.fold_in(key, _SHARE_STREAM),
                                              config.solver_share)
    return draws


def _main_loss(spec, params, mb, mb_key, config, num_steps, solve_options, draws):
    """(loss sum, stats with kinetic energy and logits) of the step's main solve: the drawn
    N with the step's solver, or on a shared-solver step ``share_solver`` at its N."""
    dropout_key = mb_key if config.dropout else None

    def solve(solver, n, options):
        total, _, stats = _token_loss(spec, params, mb, num_steps=n, solver=solver,
                                      dropout_key=dropout_key, **options)
        return total, {"nfe": jnp.asarray(stats["nfe"], jnp.int32),
                       "kinetic_energy": stats.get("kinetic_energy", jnp.zeros(())),
                       "logits": stats["logits"]}

    if config.solver_share <= 0:
        return solve(config.solver, num_steps, solve_options)
    # Both solves run and one is selected: a lax.cond whose branches hold cross-device
    # reductions deadlocked the multi-device CPU runtime when its executable came from the
    # compilation cache (devices at different all-reduces), so the share costs both solves.
    shared = solve(config.share_solver, config.share_num_steps, {})
    main = solve(config.solver, num_steps, solve_options)
    return jax.tree.map(lambda a, b: jnp.where(draws["share"], a, b), shared, main)


def _distill_loss(spec, params, mb, config, coarse_n, key, teacher_logits):
    """Sum over counted tokens of KL(p_teacher ‖ p_coarse): the coarse-grid solve (Euler at
    the drawn coarse N) pulled toward the fine solve's next-token distribution."""
    logits, _ = _logits(spec, params, mb, num_steps=coarse_n, solver=config.solver,
                        dropout_key=key if config.dropout else None,
                        max_steps=max(config.distill_num_steps_choices))
    log_t = jax.nn.log_softmax(teacher_logits)
    kl = jnp.sum(jnp.exp(log_t) * (log_t - jax.nn.log_softmax(logits)), axis=-1)
    return jnp.sum(kl * mb["loss_mask"].astype(jnp.float32))


_NUM_STEPS_STREAM = 0x4E535445  # fold_in id of the N draw ("NSTE"), apart from microbatches
_DISTILL_STREAM = 0x44495354  # the coarse N and the coarse solve's grid offset ("DIST")
_SHARE_STREAM = 0x53484152  # whether a step is a shared-solver step ("SHAR")


def _steps_metric(spec: StateSpec, params: Any, num_steps: Any, solver: str | None,
                  stats: dict) -> jax.Array:
    """N of the step as a float: the drawn/configured N, else the model's default."""
    if num_steps is not None:
        return jnp.asarray(num_steps, jnp.float32)
    cfg = getattr(spec.model(params), "config", None)
    if cfg is not None and cfg.architecture == "ode":
        return jnp.asarray(cfg.num_steps, jnp.float32)
    return jnp.asarray(stats["nfe"], jnp.float32)


def jit_train_step(
    spec: StateSpec, schedule: optax.Schedule, config: StepConfig = StepConfig()
):
    """The train step jit-ed with in/out shardings and the state donated."""
    replicated = NamedSharding(spec.mesh, P())
    return jax.jit(
        make_train_step(spec, schedule, config),
        in_shardings=(spec.shardings, batch_sharding(spec.mesh, spec.rules)),
        out_shardings=(spec.shardings, replicated),
        donate_argnums=0,
    )


def abstract_batch(spec: StateSpec, batch_size: int, seq_len: int, batch_keys=BATCH_KEYS) -> dict:
    """ShapeDtypeStructs of one global batch, for ahead-of-time lowering."""
    sharding = batch_sharding(spec.mesh, spec.rules)
    dtype = lambda k: jnp.float32 if k == "loss_mask" else jnp.int32
    return {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), dtype(k), sharding=sharding)
        for k in batch_keys
    }


def make_eval_step(spec: StateSpec, num_steps: int | None = None, solver: str | None = None,
                   *, rtol: float | None = None, atol: float | None = None):
    """params, batch -> (loss sum, token count, NFE, capped): exact token-weighted sums, no
    averaging; NFE = vector-field evaluations of the batch's solve (adaptive: as chosen by
    the step-size controller at ``rtol``/``atol``; fixed grid: N·stages); capped = 1 when an
    adaptive solve stopped at its step cap short of t1 (fixed grid: 0)."""
    options = {k: v for k, v in (("rtol", rtol), ("atol", atol)) if v is not None}

    def eval_step(params, batch):
        total, count, stats = _token_loss(spec, params, batch, num_steps=num_steps,
                                          solver=solver, dropout_key=None, **options)
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
    ETA; any batch whose adaptive solve hit the step cap is reported in one warning line."""
    from ode_lm.training.metrics import Progress

    progress = Progress(label, total, unit="batches")
    loss, tokens, nfe, capped, count = 0.0, 0.0, 0.0, 0.0, 0
    for batch in batches:
        s, n, e, c = eval_step(params, batch)
        loss, tokens, nfe = loss + float(s), tokens + float(n), nfe + float(e)
        capped, count = capped + float(c), count + 1
        progress.update(count)
    progress.done()
    if tokens == 0:
        raise ValueError(f"{what} produced no counted tokens")
    if capped:
        log.warning("%s: the adaptive solver hit its step cap (%d) on %d of %d batches "
                    "(%.0f%%): their loss is of an unfinished solve; loosen rtol/atol",
                    label, solvers_lib.ADAPTIVE_MAX_STEPS, capped, count, 100 * capped / count)
    return EvalResult(loss=loss / tokens, tokens=tokens, nfe=nfe / count,
                      capped=capped / count)
