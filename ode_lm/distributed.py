"""Multi-host start-up: join the JAX distributed system before any computation.

On a TPU VM pod (and under Slurm / Open MPI) ``jax.distributed.initialize()`` finds the
coordinator, process count and process id by itself, so :func:`initialize` calls it with
no arguments there. GPU clusters and local multi-process tests pass the three settings
explicitly (or through ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID``). A plain single process does nothing. CPU processes exchange data
with gloo collectives, which must be chosen before the CPU backend starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import jax

log = logging.getLogger(__name__)

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
CPU_COLLECTIVES = ("gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job; ``mode`` says how it was set up."""

    mode: str  # 'single' | 'explicit' | 'auto'
    process_index: int
    process_count: int
    local_device_count: int
    device_count: int

    @property
    def is_primary(self) -> bool:
        return self.process_index == 0


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    address: str
    num_processes: int
    process_id: int


def _int_setting(value: int | str | None, name: str, env: str) -> int | None:
    if value is None or value == "":
        value = os.environ.get(env) or None
        source = f"${env}"
    else:
        source = name
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"distributed: {source}={value!r} is not an integer") from None


def resolve_settings(
    coordinator_address: str | None = None,
    num_processes: int | str | None = None,
    process_id: int | str | None = None,
) -> CoordinatorSettings | None:
    """Explicit coordinator settings from arguments, else the environment; None if absent.

    All three must be given together; a partial or inconsistent set is a one-line error.
    """
    address = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    count = _int_setting(num_processes, "num_processes", ENV_NUM_PROCESSES)
    pid = _int_setting(process_id, "process_id", ENV_PROCESS_ID)
    given = {"coordinator_address": address, "num_processes": count, "process_id": pid}
    if all(v is None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        have = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None)
        raise ValueError(
            f"distributed: {have} given but {' and '.join(missing)} missing; pass all three "
            f"(or set ${ENV_ADDRESS}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"distributed: coordinator_address={address!r} must be HOST:PORT, e.g. 10.0.0.2:8476"
        )
    if count < 1:
        raise ValueError(f"distributed: num_processes={count} must be >= 1")
    if not 0 <= pid < count:
        raise ValueError(f"distributed: process_id={pid} must be in [0, num_processes={count})")
    return CoordinatorSettings(address, count, pid)


def on_managed_cluster() -> bool:
    """True on a Cloud TPU VM or a Slurm / Open MPI job with more than one task."""
    try:
        from jax._src import cloud_tpu_init

        if cloud_tpu_init.running_in_cloud_tpu_vm:
            return True
    except ImportError:  # pragma: no cover - private module moved
        pass
    for env in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(env, "1") or 1) > 1:
            return True
    return False


def is_initialized() -> bool:
    return jax.distributed.is_initialized()


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | str | None = None,
    process_id: int | str | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str = "gloo",
    initialization_timeout: int = 300,
) -> ProcessInfo:
    """Join the distributed job (once); call first thing in a CLI, before any jax op.

    Explicit settings win; otherwise a TPU pod / Slurm / Open MPI job is auto-detected;
    otherwise this is a single process and nothing is initialised.
    """
    if cpu_collectives not in CPU_COLLECTIVES:
        raise ValueError(
            f"distributed: cpu_collectives={cpu_collectives!r}: expected one of {CPU_COLLECTIVES}"
        )
    settings = resolve_settings(coordinator_address, num_processes, process_id)
    if is_initialized():
        return process_info("explicit" if settings else "auto")
    if settings is not None and settings.num_processes == 1:
        return process_info("single")
    if settings is None and not on_managed_cluster():
        return process_info("single")
    # Gloo carries cross-process collectives between CPU devices; harmless on TPU/GPU.
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        if settings is None:
            jax.distributed.initialize(initialization_timeout=initialization_timeout)
        else:
            jax.distributed.initialize(
                settings.address,
                settings.num_processes,
                settings.process_id,
                local_device_ids=local_device_ids,
                initialization_timeout=initialization_timeout,
            )
    except RuntimeError as e:
        if "before" in str(e) and "backend" in str(e).lower():
            raise RuntimeError(
                "distributed.initialize() must run before any JAX computation "
                "(call it first in the CLI)"
            ) from e
        raise
    info = process_info("explicit" if settings else "auto")
    if jax.default_backend() == "cpu" and info.process_count > 1:
        warm_up_collectives()
    log.info(
        "joined distributed job: process %d of %d, %d local / %d global devices",
        info.process_index, info.process_count, info.local_device_count, info.device_count,
    )
    return info


def warm_up_collectives() -> float:
    """One all-device reduction right after joining; returns its value (= device count).

    Gloo builds its communication context at the first cross-process collective and gives
    up if a peer is not there within 30 s. Doing that here, while every process is at the
    same point, means a later train step compiling slower on one host cannot break it.
    """
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("all",))
    ones = jax.make_array_from_callback(
        (jax.device_count(),), NamedSharding(mesh, P("all")), lambda i: np.ones(1, np.float32)
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(ones)
    return float(total)


def process_info(mode: str = "single") -> ProcessInfo:
    return ProcessInfo(
        mode=mode,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
    )


def is_primary() -> bool:
    """Only process 0 writes TensorBoard summaries and progress logs."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Barrier across all processes (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def shutdown() -> None:
    if is_initialized():
        jax.distributed.shutdown()


def exit_process(code: int = 0) -> NoReturn:
    """``sys.exit(code)``, except in a multi-process CPU job: there flush and ``os._exit``.

    With gloo collectives, the CPU client's teardown at interpreter exit can block forever
    joining a thread that waits on a peer which has already exited (2 local processes hung
    in ~1 of 6 runs here, inside ``PjRtCpuClient::~PjRtCpuClient``). Callers finish their
    work first (the trainer has closed its checkpoints and writers), so the teardown is
    skipped rather than risked, after ``jax.distributed.shutdown()``'s barrier, so that no
    process leaves while another still needs the coordinator.
    """
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        shutdown()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
