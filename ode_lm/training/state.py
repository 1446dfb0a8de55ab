"""Train state: abstract shapes + shardings, sharded init, and restore targets.

The train state is a plain dict pytree (checkpoint-friendly, no framework classes):
``step`` int32, ``params`` (every ``nnx.Param`` as a pure dict), ``opt_state`` (optax),
``rng`` (raw uint32 key data), ``skipped`` (NaN/Inf steps skipped), ``bad_streak``
(consecutive skipped steps). The model's graph definition and any non-parameter state
stay outside it, in :class:`StateSpec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ode_lm import compat

ModelFn = Callable[[nnx.Rngs], nnx.Module]
TrainablePredicate = Callable[[str, Any], bool]
# (abstract params with shardings) -> concrete params with those shardings; fine-tuning
# injects one that loads a pretrained run (see ode_lm.training.saved_run.restore_params).
InitParamsFn = Callable[[Any], Any]


def default_model_fn(config: Any) -> ModelFn:
    """The model fn of a ``ModelConfig``: ``models.build_model`` (imported when called)."""
    from ode_lm.models import build_model

    return lambda rngs: build_model(config, rngs)


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """Everything static about the train state on one mesh."""

    model_fn: ModelFn
    graphdef: Any
    rest: Any  # non-Param model state (concrete, replicated), usually empty
    tx: optax.GradientTransformation
    mesh: Mesh
    rules: tuple
    abstract_state: Any  # dict of ShapeDtypeStruct with NamedSharding leaves
    shardings: Any  # dict of NamedSharding, same structure

    @property
    def abstract_params(self) -> Any:
        return self.abstract_state["params"]

    def model(self, params: Any) -> nnx.Module:
        """Rebuild the nnx model from a params pure dict (inside jit or eagerly)."""
        return nnx.merge(self.graphdef, nnx.State(params), self.rest)


def _with_sharding(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def trainable_labels(params: Any, trainable: TrainablePredicate | None) -> Any:
    from ode_lm.training.optim import path_name

    if trainable is None:
        return jax.tree.map(lambda _: "train", params)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: "train" if trainable(path_name(p), x) else "freeze", params
    )


def restrict_to_trainable(
    tx: optax.GradientTransformation, trainable: TrainablePredicate | None
) -> optax.GradientTransformation:
    """Apply ``tx`` to trainable parameters only; the rest get zero updates and no state."""
    if trainable is None:
        return tx
    return optax.multi_transform(
        {"train": tx, "freeze": optax.set_to_zero()},
        lambda params: trainable_labels(params, trainable),
    )


def build_state_spec(
    model_fn: ModelFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: tuple,
    trainable: TrainablePredicate | None = None,
) -> StateSpec:
    """Abstract train state and its shardings for ``mesh``; allocates no parameter memory.

    ``ode-lm aot`` uses this with a TPU topology mesh to lower the train step.
    """
    tx = restrict_to_trainable(tx, trainable)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        abstract_model = nnx.eval_shape(lambda: model_fn(nnx.Rngs(0)))
        graphdef, abs_params, abs_rest = nnx.split(abstract_model, nnx.Param, ...)
        param_shardings = nnx.to_pure_dict(nnx.get_named_sharding(abs_params, mesh))
    abs_params = nnx.to_pure_dict(abs_params)
    abs_params = _with_sharding(abs_params, param_shardings)
    replicated = NamedSharding(mesh, P())
    abs_opt = jax.eval_shape(tx.init, abs_params)
    # Frozen parameters (``trainable``) appear as MaskedNode in multi_transform's state.
    masked = compat.masked_node_type()
    opt_shardings = optax.tree_map_params(
        tx,
        lambda p, s: p if isinstance(p, masked) else s,
        abs_opt,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, (NamedSharding, masked)),
    )
    scalar_i32 = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = {
        "step": scalar_i32,
        "params": abs_params,
        "opt_state": abs_opt,
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "skipped": scalar_i32,
        "bad_streak": scalar_i32,
    }
    shardings = {
        "step": replicated,
        "params": param_shardings,
        "opt_state": opt_shardings,
        "rng": replicated,
        "skipped": replicated,
        "bad_streak": replicated,
    }
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )
    rest = _concrete_rest(model_fn, mesh, rules) if jax.tree.leaves(abs_rest) else abs_rest
    return StateSpec(model_fn, graphdef, rest, tx, mesh, rules, abstract, shardings)


def _concrete_rest(model_fn: ModelFn, mesh: Mesh, rules: tuple) -> Any:
    """Non-parameter model state (e.g. RNG counters); jit drops the unused parameters."""

    def make():
        return nnx.split(model_fn(nnx.Rngs(0)), nnx.Param, ...)[2]

    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        return jax.jit(make)()


def _state_from(spec: StateSpec, params: Any, seed_key: jax.Array) -> dict:
    zero = jnp.zeros((), jnp.int32)
    return {
        "step": zero,
        "params": params,
        "opt_state": spec.tx.init(params),
        "rng": jax.random.key_data(seed_key).astype(jnp.uint32),
        "skipped": zero,
        "bad_streak": zero,
    }


def init_state(spec: StateSpec, seed: int) -> dict:
    """Fresh state created directly with its shardings (``jax.jit(init, out_shardings)``)."""

    def init(seed_array):
        key = jax.random.key(seed_array)
        param_key, train_key = jax.random.split(key)
        model = spec.model_fn(nnx.Rngs(param_key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return _state_from(spec, params, train_key)

    with jax.set_mesh(spec.mesh), nnx.logical_axis_rules(spec.rules):
        return jax.jit(init, out_shardings=spec.shardings)(jnp.uint32(seed))


def state_from_params(spec: StateSpec, params: Any, seed: int) -> dict:
    """A step-0 state around given (already sharded) params: fine-tuning's entry point."""

    def build(params, seed_array):
        _, train_key = jax.random.split(jax.random.key(seed_array))
        return _state_from(spec, params, train_key)

    with jax.set_mesh(spec.mesh), nnx.logical_axis_rules(spec.rules):
        return jax.jit(build, out_shardings=spec.shardings)(params, jnp.uint32(seed))
