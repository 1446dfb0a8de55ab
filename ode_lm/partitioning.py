"""Device mesh and THE logical-axis → mesh-axis rules table.

Every parameter and every large activation in ode-lm carries *logical* axis names
(``'embed'``, ``'mlp'``, ``'activation_batch'`` ...). This module is the only place
that maps them onto the physical mesh axes ``('data', 'fsdp', 'tensor')``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# Logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
# Parameters (hypernetwork included) are FSDP-sharded on 'embed' and tensor-parallel on
# 'mlp' / 'heads' / 'vocab'. The time axes of the hypernetwork are small and replicated,
# so generating W(t) = W0 + sum_d g_d(t) A_d is a purely local computation whose result
# already has its kernel's sharding.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # --- parameters ---
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),            # head_dim
    ("qkv", None),           # the fused q/k/v axis of size 3
    ("position", None),      # learned absolute positions
    ("norm", None),          # 1-D norm scales/biases over the embedding
    ("layers", None),        # stacked discrete layers / ODE steps of materialised models
    ("time_embed", None),    # D: hypernetwork coefficient axis
    ("time_features", None), # 2S+1: sinusoidal time features
    ("time_hidden", None),   # hidden width of the per-weight time MLP
    ("lora_rank", None),     # rank r of the LoRA factors A [in..., r], B [r, out...]
    # --- activations ---
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("activation_steps", None),
)


# --------------------------------------------------------------------------- mesh


def resolve_parallelism(parallelism: Sequence[int], num_devices: int, what: str) -> tuple[int, ...]:
    """Fill the single -1 of a (data, fsdp, tensor) parallelism so the product is num_devices."""
    dims = tuple(int(d) for d in parallelism)
    if len(dims) != len(MESH_AXES):
        raise ValueError(f"{what}={dims}: expected {len(MESH_AXES)} entries for axes {MESH_AXES}")
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
        raise ValueError(f"{what}={dims}: entries must be >= 1, with at most one -1")
    known = math.prod(d for d in dims if d != -1)
    if num_devices % known:
        raise ValueError(
            f"{what}={dims} does not divide the device count {num_devices} "
            f"(product of fixed axes is {known})"
        )
    if -1 in dims:
        dims = tuple(num_devices // known if d == -1 else d for d in dims)
    elif known != num_devices:
        raise ValueError(
            f"{what}={dims} uses {known} devices but {num_devices} are available; "
            "use -1 on one axis to fill the rest"
        )
    return dims


def create_mesh(
    ici_parallelism: Sequence[int] = (1, -1, 1),
    dcn_parallelism: Sequence[int] = (1, 1, 1),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Build the ('data', 'fsdp', 'tensor') mesh, MaxText style, with Auto axis types.

    ``ici_parallelism`` shapes the devices of one slice, ``dcn_parallelism`` the slices
    (multi-slice: each mesh axis is ``ici * dcn`` long). One -1 in each is filled in.
    """
    devices = list(jax.devices() if devices is None else devices)
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    dcn = resolve_parallelism(dcn_parallelism, num_slices, "dcn_parallelism")
    per_slice = len(devices) // num_slices
    ici = resolve_parallelism(ici_parallelism, per_slice, "ici_parallelism")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if num_slices > 1:
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
    elif devices[0].platform in ("tpu", "gpu") and len(devices) == len(jax.devices()):
        grid = mesh_utils.create_device_mesh(ici, devices=devices)
    else:
        grid = np.asarray(devices, dtype=object).reshape(ici)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def axis_rules(overrides: Sequence[tuple[str, Any]] = ()) -> tuple[tuple[str, Any], ...]:
    """THE rules table with ``overrides`` (logical name -> mesh axes) replacing its entries.

    A run sets them as ``MeshConfig.rule_overrides`` to change a mapping without a second table.
    """
    table = dict(LOGICAL_AXIS_RULES)
    for name, target in overrides:
        if name not in table:
            raise ValueError(f"MeshConfig.rule_overrides: unknown logical axis {name!r}")
        if isinstance(target, list):
            target = tuple(target)
        for axis in target if isinstance(target, tuple) else (target,):
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(
                    f"MeshConfig.rule_overrides: {name!r} -> {target!r} names no mesh axis "
                    f"{MESH_AXES}"
                )
        table[name] = target
    return tuple(table.items())


def logical_to_mesh(spec: Sequence[str | None], rules: Sequence[tuple[str, Any]]) -> P:
    """Map one logical PartitionSpec (e.g. ('activation_batch', None)) to mesh axes."""
    table = dict(rules)
    return P(*(None if name is None else table[name] for name in spec))


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]]):
    """Sharding of every [B, T] batch array: batch over activation_batch as the run's
    ``rules`` map it ((data, fsdp) in the default table). No default: a caller that forgot
    the run's overrides would lay the batch out unlike the train step expects."""
    return NamedSharding(mesh, logical_to_mesh(("activation_batch", None), rules))


def batch_shards(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> int:
    """How many ways the batch dimension is split on this mesh under the run's ``rules``."""
    spec = logical_to_mesh(("activation_batch",), rules)[0]
    axes = spec if isinstance(spec, tuple) else (() if spec is None else (spec,))
    return math.prod(mesh.shape[a] for a in axes)


# ----------------------------------------------------------------- sharding report


def bytes_per_device(x: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Bytes one device holds for ``x`` under its sharding."""
    itemsize = np.dtype(x.dtype).itemsize
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return int(math.prod(x.shape)) * itemsize
    return int(math.prod(sharding.shard_shape(x.shape))) * itemsize


def path_name(path: tuple) -> str:
    """'a/b/0/kernel' for a jax key path: the one spelling of parameter names (sharding
    table, weight-decay and trainable predicates, checkpoints, exports)."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def sharding_table(params: Any) -> tuple[str, int, int]:
    """(text table, bytes per device, total bytes) for a pytree of sharded params."""
    rows, per_dev, total = [], 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_name(path)
        spec = getattr(getattr(leaf, "sharding", None), "spec", P())
        b = bytes_per_device(leaf)
        per_dev += b
        total += int(math.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        rows.append((name, str(tuple(leaf.shape)), str(spec), f"{b:,}"))
    header = ("parameter", "shape", "partition spec", "bytes/device")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.append(f"total: {total:,} bytes, per device: {per_dev:,} bytes")
    return "\n".join(lines), per_dev, total


def sharding_text(mesh: Mesh, table: str) -> str:
    """The table as a run keeps it (``RunDir.write_run_files``)."""
    return f"parameter sharding on mesh {dict(mesh.shape)}:\n{table}\n"


def log_sharding_table(mesh: Mesh, table: str) -> None:
    """The table on the console only at DEBUG (``--verbose``): at INFO its ~50 lines would
    bury a failed run's one-line error; a run keeps it in its run directory."""
    logging.getLogger("ode_lm.train").debug("%s", sharding_text(mesh, table).rstrip())


def check_param_annotations(params: Any) -> None:
    """Fail on a parameter without logical-axis names (one per dimension).

    Such a parameter is silently replicated on every device. Replication chosen through
    the rules (logical names mapped to no mesh axis, like the norms' time MLPs) is fine:
    it shows as ``P(None, ...)`` in the sharding table, a forgotten annotation as ``P()``.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        if spec is not None and len(leaf.shape) and len(spec) != len(leaf.shape):
            raise ValueError(
                f"parameter {path_name(path)!r} {tuple(leaf.shape)} has partition spec "
                f"{spec}: it is missing a logical-axis annotation (give it sharding_names, one "
                "logical axis per dimension; --verbose prints the sharding table)"
            )
