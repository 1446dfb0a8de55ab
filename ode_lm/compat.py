"""The private library APIs ode-lm relies on, each behind one function here.

jax, orbax, optax and gin expose no public way to do these few things; each access below
names what it reaches into, so a version bump that moves one fails in one place, loudly,
naming the call (``CompatError``), and ``tests/pod/test_compat.py`` calls every one of them.
This module imports gin only for its private config table: the gin owner (``gin_setup``)
is its one caller there.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class CompatError(RuntimeError):
    """A private library API ode-lm relies on is gone or changed (a version bump)."""


def _private(what: str) -> Callable[[F], F]:
    """Turn an ImportError/AttributeError inside the access into a CompatError naming it."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (ImportError, AttributeError, KeyError, TypeError) as e:
                raise CompatError(f"private API {what} is gone or changed in the installed "
                                  f"version ({type(e).__name__}: {e}); see ode_lm/compat.py"
                                  ) from e

        call.private_api = what  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap


# ------------------------------------------------------------------ jax


@_private("jax._src.distributed.global_state.client")
def coordination_client() -> Any:
    """JAX's coordination-service client (None before ``jax.distributed.initialize``)."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


@_private("jax._src.cloud_tpu_init.running_in_cloud_tpu_vm")
def running_in_cloud_tpu_vm() -> bool:
    from jax._src import cloud_tpu_init

    return bool(cloud_tpu_init.running_in_cloud_tpu_vm)


@_private("jax._src.cloud_tpu_init.get_tpu_library_path")
def tpu_library_path() -> str | None:
    """Where libtpu is installed (None: not installed)."""
    from jax._src import cloud_tpu_init

    return cloud_tpu_init.get_tpu_library_path()


@_private("jax._src.hardware_utils.num_available_tpu_chips_and_device_id")
def quiet_libtpu_off_tpu(accelerator_type: str) -> None:
    """Off a TPU VM (no TPU chips: jax then skips the metadata server), libtpu loaded for
    compile-only devices prints three lines of noise about the accelerator type and worker
    hostnames it cannot look up; naming them here (unless the environment already does)
    silences it. On a TPU VM nothing is set: the runtime finds its own."""
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


# ------------------------------------------------------------------ optax


@_private("optax.transforms._masking.MaskedNode")
def masked_node_type() -> type:
    """The leaf ``optax.multi_transform`` puts in a frozen parameter's optimizer state."""
    import optax

    return optax.transforms._masking.MaskedNode


# ------------------------------------------------------------------ orbax


@_private("orbax.checkpoint._src.multihost.multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER")
def orbax_distributed_barrier_flag() -> str:
    """The absl flag that makes orbax synchronise through the coordination service."""
    from orbax.checkpoint._src.multihost import multihost

    return multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name


# ------------------------------------------------------------------ gin


@_private("gin.config._CONFIG, gin.config._format_value")
def gin_macros() -> dict[str, str]:
    """NAME -> value (gin's text) of every macro the parsed config defines, in the order
    they were first defined."""
    from gin import config as gin_config

    return {scope: gin_config._format_value(params["value"])
            for (scope, selector), params in gin_config._CONFIG.items()
            if selector == "gin.macro" and "value" in params}


@_private("gin.config._CONFIG, gin.config.iterate_references")
def gin_macro_references() -> set[str]:
    """Macros the parsed config refers to (``%NAME`` anywhere)."""
    from gin import config as gin_config

    return {ref.config_key[0] for ref in gin_config.iterate_references(gin_config._CONFIG)
            if ref.config_key[1] == "gin.macro"}
