"""Multi-host start-up: join the JAX distributed system before any computation.

On a TPU VM pod (and under Slurm / Open MPI) ``jax.distributed.initialize()`` finds the
coordinator, process count and process id by itself, so :func:`initialize` calls it with
no arguments there. GPU clusters and local multi-process tests pass the three settings
explicitly (or through ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID``). A plain single process does nothing. CPU processes exchange data
with gloo collectives, which must be chosen before the CPU backend starts.

A process that dies (SIGKILL, a lost host) would leave the others blocked in their next
collective. JAX's coordination service notices the silence after
``DistributedConfig.heartbeat_timeout_seconds``; by default it then aborts every other process
with a C++ stack trace. :func:`initialize` instead turns on JAX's recoverable-task mode (the
service only records the loss) and starts a :class:`PeerWatchdog` that polls the service's
live-process list and ends this process with one line naming the lost process.

Over 400 lines: a job's whole life (join, watchdog, lost-peer errors, shutdown, exit) shares
the coordination client's state, so it stays in one module.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import jax

from ode_lm import compat
from ode_lm.config_types import check_types, require_at_least, require_positive

log = logging.getLogger(__name__)

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
CPU_COLLECTIVES = ("gloo", "mpi")
EXIT_PEER_LOST = 1  # exit status of a process stopped because a peer was lost


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How a multi-process job detects a lost process (gin: ``DistributedConfig.*``).

    A process that sends no heartbeat for ``heartbeat_timeout_seconds`` counts as lost; the
    others then exit (status 1) within about that time plus ``watchdog_poll_seconds``.
    """

    heartbeat_timeout_seconds: int = 100  # JAX's own default
    shutdown_timeout_seconds: int = 300
    initialization_timeout: int = 300
    watchdog: bool = True  # False: JAX's default (abort with a C++ stack trace)
    watchdog_poll_seconds: float = 1.0

    def __post_init__(self):
        check_types(self)
        require_at_least(self, 1, "heartbeat_timeout_seconds", "shutdown_timeout_seconds",
                         "initialization_timeout")
        require_positive(self, "watchdog_poll_seconds")


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
        if compat.running_in_cloud_tpu_vm():
            return True
    except compat.CompatError as e:  # pragma: no cover - jax moved it: env vars still tell
        log.warning("%s", e)
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
    config: DistributedConfig | None = None,
) -> ProcessInfo:
    """Join the distributed job (once); call first thing in a CLI, before any jax op.

    Explicit settings win; otherwise a TPU pod / Slurm / Open MPI job is auto-detected;
    otherwise this is a single process and nothing is initialised. ``config``: the timeouts
    (the gin CLIs hand the gin-bound one, ``gin_setup.GinDistributedConfig()``).
    """
    config = config or DistributedConfig()
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
    # Recoverable tasks: the service records a lost process instead of aborting the others
    # (LOG(FATAL)); the watchdog below reports it. (Read by process 0, which hosts it.)
    jax.config.update("jax_enable_recoverability", config.watchdog)
    timeouts = dict(initialization_timeout=config.initialization_timeout,
                    heartbeat_timeout_seconds=config.heartbeat_timeout_seconds,
                    shutdown_timeout_seconds=config.shutdown_timeout_seconds)
    try:
        if settings is None:
            jax.distributed.initialize(**timeouts)
        else:
            jax.distributed.initialize(
                settings.address,
                settings.num_processes,
                settings.process_id,
                local_device_ids=local_device_ids,
                **timeouts,
            )
    except RuntimeError as e:
        if "before" in str(e) and "backend" in str(e).lower():
            raise RuntimeError(
                "distributed.initialize() must run before any JAX computation "
                "(call it first in the CLI)"
            ) from e
        raise
    info = process_info("explicit" if settings else "auto")
    global _watchdog, _config
    _config = config
    if config.watchdog and info.process_count > 1:
        _watchdog = PeerWatchdog(
            _client(), info.process_count, info.process_index, config.heartbeat_timeout_seconds,
            config.watchdog_poll_seconds,
        ).start()
        atexit.register(_stop_watchdog)  # runs before JAX's own atexit shutdown (LIFO)
    if jax.default_backend() == "cpu" and info.process_count > 1:
        warm_up_collectives()
    log.info(
        "joined distributed job: process %d of %d, %d local / %d global devices",
        info.process_index, info.process_count, info.local_device_count, info.device_count,
    )
    return info


def _client() -> Any:
    """JAX's coordination-service client (``compat.coordination_client``)."""
    return compat.coordination_client()


class PeerWatchdog:
    """A daemon thread that ends this process, with one line, once a peer is lost.

    A surviving process is typically blocked inside a collective that will never complete,
    so the thread cannot raise into it: it writes the line to stderr and calls ``os._exit``.
    """

    def __init__(self, client: Any, num_processes: int, process_id: int,
                 heartbeat_timeout: int, poll_seconds: float,
                 on_lost: Callable[[str], Any] | None = None):
        self.client, self.num_processes, self.process_id = client, num_processes, process_id
        self.heartbeat_timeout, self.poll_seconds = heartbeat_timeout, poll_seconds
        self.on_lost = on_lost or _exit_peer_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> str | None:
        """The message naming the lost process(es), or None while every process is alive."""
        ids = list(range(self.num_processes))
        try:
            live = self.client.get_live_nodes(ids)
        except Exception as e:  # noqa: BLE001 - any failure to reach the service counts
            if self.process_id == 0:  # the service runs in this process: cannot be unreachable
                return f"distributed: cannot query the coordination service: {e}"
            lost, why = "the coordinator, process 0", "its service is unreachable"
        else:
            missing = [i for i in ids if i not in live]
            if not missing:
                return None
            lost = "process" + ("es " if len(missing) > 1 else " ") + ", ".join(map(str, missing))
            why = f"no heartbeat for {self.heartbeat_timeout} s"
        return (
            f"distributed: lost {lost} of {self.num_processes} ({why}); stopping process "
            f"{self.process_id}. Restart all processes to resume from the last complete "
            "checkpoint"
        )

    def start(self) -> PeerWatchdog:
        self._thread = threading.Thread(target=self._run, name="ode_lm-peer-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop polling (before a deliberate shutdown, when peers leave on purpose)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            message = self.check()
            if message is not None and not self._stop.is_set():
                self.on_lost(message)
                return


def _exit_peer_lost(message: str) -> NoReturn:
    """One line on stderr, then leave at once (the main thread may be stuck in a collective)."""
    line = f"ode-lm: error: {message}\n"
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001, S110 - leaving anyway
        pass
    os.write(2, line.encode())
    os._exit(EXIT_PEER_LOST)


_watchdog: PeerWatchdog | None = None
_config: DistributedConfig | None = None


def _stop_watchdog() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def _from_runtime(error: BaseException | None, depth: int = 0) -> bool:
    """A JaxRuntimeError, or an error raised while handling one (a ``finally`` clean-up)."""
    if error is None or depth > 8:
        return False
    if isinstance(error, jax.errors.JaxRuntimeError):
        return True
    return _from_runtime(error.__cause__ or error.__context__, depth + 1)


def wait_for_lost_peer(error: BaseException) -> None:
    """Before reporting ``error``: if it is a JAX runtime error in a multi-process job, wait
    (at most the heartbeat timeout) for the watchdog to confirm a lost process. An error
    raised while handling one (a clean-up in a ``finally``) counts too.

    A peer's death often surfaces first as a failed collective ("Gloo AllGather failed ...
    Connection reset by peer") long before the heartbeat timeout; the watchdog's line, which
    names the lost process, is the one to show then (it ends the process itself). Any other
    error, or none confirmed in time, returns at once / after the wait, to be reported as is.
    """
    dog = _watchdog
    if dog is None or not _from_runtime(error):
        return
    deadline = time.monotonic() + dog.heartbeat_timeout + 2 * dog.poll_seconds
    while time.monotonic() < deadline and dog.is_alive():
        time.sleep(min(dog.poll_seconds, 0.5))


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
    """Leave the job together: wait for every process, stop the watchdog, then disconnect.

    Recoverable-task mode drops JAX's own shutdown barrier, so the wait is explicit here: no
    process (least of all process 0, which hosts the service) leaves while another still
    needs the coordinator. The watchdog stops once every process has arrived.
    """
    if is_initialized():
        if jax.process_count() > 1:
            # the watchdog keeps watching during the barrier: a peer lost now is reported
            timeout_s = (_config or DistributedConfig()).shutdown_timeout_seconds
            try:
                _client().wait_at_barrier("ode_lm_shutdown", timeout_s * 1000)
            except Exception as e:  # noqa: BLE001 - a peer already gone: leave anyway
                log.warning("distributed: shutdown barrier failed: %s", e)
        _stop_watchdog()
        if jax.process_count() > 1 and jax.process_index() == 0:
            _wait_for_others_to_disconnect(timeout_s)
        jax.distributed.shutdown()
    _stop_watchdog()


def _wait_for_others_to_disconnect(timeout_s: float) -> None:
    """Process 0 hosts the service: stopping it while a peer still disconnects fails that
    peer's ShutdownTask RPC, and JAX aborts the peer (a C++ stack trace, exit -6)."""
    ids = list(range(jax.process_count()))  # the asking process must be among them
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if set(_client().get_live_nodes(ids)) <= {0}:
                return
        except Exception:  # noqa: BLE001 - nothing more to wait for
            return
        time.sleep(0.05)


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
