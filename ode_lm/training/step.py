"""Loss, train step and eval step: pure functions of (state, batch), jit-ed by the caller.

``make_train_step(spec, ...)`` and ``jit_train_step(spec, ...)`` are what the trainer and
``tools/aot_compile.py`` use; the latter lowers it against ``spec.abstract_state``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ode_lm.partitioning import batch_sharding, logical_to_mesh
from ode_lm.training.state import StateSpec

Batch = Mapping[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the train step."""

    microbatches: int = 1  # gradient accumulation
    num_steps: int | None = None  # ODE steps for training (None = the model's default)
    solver: str | None = None
    # Stochastic forward (dropout, random grid offset) with a per-step RNG; None: on when
    # the model config asks for dropout or a random grid offset.
    dropout: bool | None = None


def token_loss_sums(
    spec: StateSpec,
    params: Any,
    batch: Batch,
    *,
    num_steps: int | None = None,
    solver: str | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token cross-entropy, number of counted tokens) for one batch."""
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
        )
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


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

    def train_step(state: dict, batch: Batch) -> tuple[dict, dict]:
        params = state["params"]
        step = state["step"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
        num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

        def loss_fn(p, mb, mb_key):
            total, _ = token_loss_sums(
                spec, p, mb, num_steps=config.num_steps, solver=config.solver,
                dropout_key=mb_key if config.dropout else None,
            )
            return total / num_tokens

        grad_fn = jax.value_and_grad(loss_fn)
        if k == 1:
            loss, grads = grad_fn(params, batch, key)
        else:
            micro = _split_microbatches(batch, k, spec)

            def body(carry, xs):
                loss_acc, grad_acc = carry
                mb, i = xs
                loss_i, g = grad_fn(params, mb, jax.random.fold_in(key, i))
                return (loss_acc + loss_i, jax.tree.map(jnp.add, grad_acc, g)), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss, grads), _ = jax.lax.scan(body, (jnp.zeros(()), zeros), (micro, jnp.arange(k)))

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
        }
        return new_state, metrics

    return train_step


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


def make_eval_step(spec: StateSpec, num_steps: int | None = None, solver: str | None = None):
    """params, batch -> (loss sum, token count): exact token-weighted sums, no averaging."""

    def eval_step(params, batch):
        return token_loss_sums(spec, params, batch, num_steps=num_steps, solver=solver)

    replicated = NamedSharding(spec.mesh, P())
    return jax.jit(
        eval_step,
        in_shardings=(spec.shardings["params"], batch_sharding(spec.mesh, spec.rules)),
        out_shardings=(replicated, replicated),
    )
