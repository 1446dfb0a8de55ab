"""Local multi-process JAX jobs on this CPU: ports, worker environments, spawning, results
(shared by the multi-host and host-fault tests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(pid: int, num_processes: int, devices_per_process: int, port: int) -> dict:
    """The environment of process ``pid`` of a local CPU job on 127.0.0.1:``port``."""
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(pid))


def spawn(argv: list[str], num_processes: int, devices_per_process: int, port: int,
          cwd: str | None = None, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Start ``num_processes`` local processes as one JAX job; wait for all of them."""
    procs = []
    for pid in range(num_processes):
        procs.append(subprocess.Popen(argv, env=worker_env(pid, num_processes,
                                                           devices_per_process, port),
                                      cwd=cwd, text=True,
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
