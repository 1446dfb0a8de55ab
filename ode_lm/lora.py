"""LoRA for adaptive fine-tuning: W ← W + (α/r)·A·B on chosen linear maps of any ode-lm model.

LoRA acts on *parameters*, not on module calls: ``LoRAModel`` wraps a model, and on every
forward it rebuilds the wrapped model with its target kernels replaced by W + (α/r)·A·B.
So the same code covers

* the materialised M-layer model, whose kernels are stacked over layers (``qkv_kernel`` of
  shape [L, E, 3, H, Dh]: one A, B pair per layer), and
* the continuous model, where the targets are the hypernetworks' base weights W₀ of
  W(t) = W₀ + Σ_d g_d(t)·A_d, so the low-rank update is shared by every depth t.

Targets are the block's linear maps by name (``qkv``, ``out``, ``mlp_in``, ``mlp_up``,
``mlp_gate``, ``mlp_out``; shell patterns such as ``mlp_*`` allowed). The kernel's input axes
(from ``vector_field.dense_specs``) stay A's leading axes and its output axes B's trailing
ones, with their logical names, so the factors shard like the kernel. ``merge_lora`` folds
the update back for export.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from typing import Any

import jax.numpy as jnp
from flax import nnx

from ode_lm.config_types import check_types
from ode_lm.models.common import mesh_active
from ode_lm.models.config import ModelConfig
from ode_lm.models.vector_field import dense_specs

LORA_COLLECTION = "lora"
LORA_RANK_AXIS = "lora_rank"  # logical axis of the rank r (replicated: r is small)
# Parameter paths of token / position embeddings and of an untied head (optionally trainable).
EMBEDDING_REGEX = r"(^|/)(embeddings/(token|position)|head/kernel)$"


class LoRAParam(nnx.Param):
    """A LoRA factor (an ``nnx.Param``, so the trainer's state and checkpoints hold it)."""


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("qkv", "out", "mlp_*")

    def __post_init__(self):
        check_types(self)
        if self.rank <= 0:
            raise ValueError(f"LoRA rank={self.rank}: must be >= 1")
        if not self.targets:
            raise ValueError("LoRA targets: empty; name at least one linear map (e.g. 'qkv')")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class LoRATarget:
    path: tuple[Any, ...]  # path of the kernel Param inside the wrapped model
    key: str  # its name in the LoRA dict
    lead: tuple[int, ...]  # leading (stacked layer) dims
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    a_axes: tuple[str | None, ...]  # lead + the kernel's input axes + lora_rank
    b_axes: tuple[str | None, ...]  # lead + lora_rank + the kernel's output axes

    @property
    def in_size(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_size(self) -> int:
        return math.prod(self.out_shape)


def _dense_name(path: tuple[Any, ...], names: dict) -> str | None:
    """The linear map a kernel Param belongs to, or None if it is not a LoRA-able kernel."""
    last = str(path[-1])
    if last.endswith("_kernel") and last[: -len("_kernel")] in names:
        return last[: -len("_kernel")]
    if last == "w0" and len(path) >= 2 and str(path[-2]) in names:  # TemporalDense base W₀
        return str(path[-2])
    return None


def find_lora_targets(model: nnx.Module, config: ModelConfig, spec: LoRASpec) -> list[LoRATarget]:
    """Every kernel matched by ``spec.targets``; a pattern matching nothing is an error."""
    specs = dense_specs(config)
    found: list[LoRATarget] = []
    used: set[str] = set()
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = _dense_name(path, specs)
        if name is None:
            continue
        hits = [p for p in spec.targets if fnmatch.fnmatchcase(name, p)]
        if not hits:
            continue
        used.update(hits)
        d = specs[name]
        n_in, n_out = len(d.in_shape), len(d.out_shape)
        shape = tuple(var.shape)
        lead = shape[: len(shape) - n_in - n_out]
        axes = tuple(getattr(var, "out_sharding", None) or (None,) * len(shape))
        lead_axes = axes[: len(lead)]
        # A and B keep the kernel's own axes (a qkv factor stays sharded over heads)
        a_axes = lead_axes + tuple(d.in_axes) + (LORA_RANK_AXIS,)
        b_axes = lead_axes + (LORA_RANK_AXIS,) + tuple(d.out_axes)
        key = "__".join(str(p) for p in path)
        found.append(LoRATarget(path, key, lead, tuple(d.in_shape), tuple(d.out_shape),
                                a_axes, b_axes))
    unused = [p for p in spec.targets if p not in used]
    if unused:
        raise ValueError(
            f"LoRA target(s) {unused} match no linear layer of this {config.flavour} model; "
            f"available: {sorted(specs)}"
        )
    return found


class LoRAModel(nnx.Module):
    """``base`` with trainable low-rank updates on its target kernels (B = 0 at init)."""

    def __init__(self, base: nnx.Module, config: ModelConfig, spec: LoRASpec, rngs: nnx.Rngs):
        self.base = base
        self.scale = spec.scale
        self.targets = tuple(find_lora_targets(base, config, spec))
        factors = {}
        for t in self.targets:
            a_init = nnx.initializers.normal(t.in_size**-0.5)
            factors[t.key] = nnx.Dict(
                a=_lora_param(rngs.params(), a_init, t.lead + (t.in_size, spec.rank),
                              t.lead + t.in_shape + (spec.rank,), t.a_axes),
                b=_lora_param(rngs.params(), nnx.initializers.zeros,
                              t.lead + (spec.rank, t.out_size),
                              t.lead + (spec.rank,) + t.out_shape, t.b_axes),
            )
        self.lora = nnx.Dict(factors)

    def merged(self) -> nnx.Module:
        """The wrapped model with W + (α/r)·A·B in place of each target kernel."""
        graphdef, state = nnx.split(self.base)
        flat = dict(nnx.to_flat_state(state))
        for t in self.targets:
            var = flat[t.path]
            w = var[...]
            f = self.lora[t.key]
            rank = f["a"].shape[-1]
            a = f["a"][...].reshape(t.lead + (t.in_size, rank))
            b = f["b"][...].reshape(t.lead + (rank, t.out_size))
            delta = jnp.matmul(a, b) * self.scale
            flat[t.path] = var.replace(w + delta.reshape(w.shape).astype(w.dtype))
        return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))

    def __call__(self, *args, **kwargs):
        return self.merged()(*args, **kwargs)


def _lora_param(key, init, flat_shape, shape, axes) -> LoRAParam:
    """Drawn as the [in, r] / [r, out] matrix, then given the kernel's axes (same values as a
    flat factor, so runs reproduce)."""
    value = init(key, tuple(flat_shape), jnp.float32).reshape(shape)
    return LoRAParam(value, out_sharding=tuple(axes), eager_sharding=mesh_active())


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold LoRA updates into the weights (identity for a model without LoRA)."""
    return model.merged() if isinstance(model, LoRAModel) else model


def lora_trainable(train_embeddings: bool = False):
    """Trainer predicate (path, leaf) -> bool: LoRA factors, plus embeddings if asked."""
    emb = re.compile(EMBEDDING_REGEX)

    def trainable(path: str, leaf: Any) -> bool:
        if path.startswith(f"{LORA_COLLECTION}/"):
            return True
        return train_embeddings and bool(emb.search(path))

    return trainable


def lora_spec_from_dict(d: dict[str, Any]) -> LoRASpec:
    return LoRASpec(rank=int(d["rank"]), alpha=float(d["alpha"]), targets=tuple(d["targets"]))


def lora_model_fn(config: ModelConfig, spec: LoRASpec):
    """Trainer ``model_fn``: the model of ``config`` wrapped with LoRA factors."""
    from ode_lm.models import build_model

    def make(rngs: nnx.Rngs) -> LoRAModel:
        return LoRAModel(build_model(config, rngs), config, spec, rngs)

    return make
