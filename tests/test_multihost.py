"""Multi-host: ode_lm.distributed settings, and real multi-process JAX jobs on this CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import pytest

from ode_lm import distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], num_processes: int, devices_per_process: int, port: int,
          cwd: str | None = None, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Start ``num_processes`` local processes as one JAX job; wait for all of them."""
    procs = []
    for pid in range(num_processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen(argv, env=env, cwd=cwd, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def result_line(stdout: str) -> dict:
    """The JSON a worker printed after 'RESULT ' (gloo also writes to stdout)."""
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture()
def clean_env(monkeypatch):
    for var in (distributed.ENV_ADDRESS, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_no_settings_means_single_process(clean_env):
    assert distributed.resolve_settings() is None
    info = distributed.initialize()
    assert info.mode == "single" and info.process_count == 1 and info.is_primary
    assert info.device_count == jax.device_count() == 8
    assert not distributed.is_initialized()


def test_settings_from_arguments_and_environment(clean_env, monkeypatch):
    s = distributed.resolve_settings("10.0.0.2:8476", 4, 3)
    assert s == distributed.CoordinatorSettings("10.0.0.2:8476", 4, 3)
    monkeypatch.setenv(distributed.ENV_ADDRESS, "127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    assert distributed.resolve_settings() == distributed.CoordinatorSettings("127.0.0.1:1234", 2, 1)
    # an explicit argument beats the environment
    assert distributed.resolve_settings(process_id=0).process_id == 0


def test_one_explicit_process_does_not_initialize(clean_env):
    info = distributed.initialize("127.0.0.1:1234", 1, 0)
    assert info.mode == "single" and not distributed.is_initialized()


@pytest.mark.parametrize(
    "args, message",
    [
        (("127.0.0.1:1234", None, None), "num_processes and process_id missing"),
        ((None, 2, None), "coordinator_address and process_id missing"),
        (("127.0.0.1", 2, 0), "must be HOST:PORT"),
        (("127.0.0.1:99999", 2, 0), "must be HOST:PORT"),
        (("127.0.0.1:1234", 0, 0), "num_processes=0 must be >= 1"),
        (("127.0.0.1:1234", 2, 2), "process_id=2 must be in [0, num_processes=2)"),
        (("127.0.0.1:1234", "two", 0), "num_processes='two' is not an integer"),
    ],
)
def test_bad_settings_are_clear_errors(clean_env, args, message):
    with pytest.raises(ValueError, match="^distributed: ") as e:
        distributed.resolve_settings(*args)
    assert message in str(e.value)


def test_bad_environment_names_the_variable(clean_env, monkeypatch):
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "x")
    with pytest.raises(ValueError, match=r"\$JAX_PROCESS_ID='x' is not an integer"):
        distributed.resolve_settings()


def test_bad_cpu_collectives(clean_env):
    with pytest.raises(ValueError, match="cpu_collectives='nccl'"):
        distributed.initialize(cpu_collectives="nccl")


def test_managed_cluster_detection(clean_env, monkeypatch):
    assert not distributed.on_managed_cluster()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.on_managed_cluster()


COLLECTIVE_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ode_lm import distributed
    info = distributed.initialize()
    mesh = jax.make_mesh((jax.device_count(),), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    # each process contributes only its own rows: a global array from host-local data
    local = np.arange(info.local_device_count, dtype=np.float32) + 100 * info.process_index
    x = jax.make_array_from_process_local_data(sharding, local, (jax.device_count(),))
    total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, P()))(x)
    distributed.sync("done")
    print("RESULT", json.dumps({"mode": info.mode, "index": info.process_index,
                      "count": info.process_count, "local": info.local_device_count,
                      "global": info.device_count, "primary": distributed.is_primary(),
                      "total": float(total)}))
    distributed.shutdown()
""")


def test_two_processes_form_one_job():
    """2 processes x 4 CPU devices: one 8-device mesh, a reduction across both hosts."""
    results = spawn([sys.executable, "-c", COLLECTIVE_SCRIPT], 2, 4, free_port(), timeout=120)
    outs = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(result_line(r.stdout))
    expected = float(sum(v * v for v in [0, 1, 2, 3, 100, 101, 102, 103]))
    for i, o in enumerate(outs):
        assert o == {"mode": "explicit", "index": i, "count": 2, "local": 4, "global": 8,
                     "primary": i == 0, "total": expected}
