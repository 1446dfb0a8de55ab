"""Where a figure came from: the command, the commit, the date and the machine.

Every JSON a figure of the docs is regenerated from (``ode-lm train``'s ``summary.json``,
``ode-lm bench --json``, ``ode-lm depth-report --json``, ``ode-lm depth-gap table --json``)
carries this record under ``"provenance"``, so a reader can tell what produced a number and
on what, and rerun it. Nothing here imports jax.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ode_lm import hardware

REPO = Path(__file__).resolve().parent.parent


def git_commit(repo: Path = REPO) -> str | None:
    """HEAD of the checkout ode-lm runs from, ``+dirty`` with uncommitted changes to tracked
    files; None outside a git checkout (an installed wheel)."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "-uno"],
                               check=True, capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine() -> dict[str, Any]:
    """The CPU model, the cores this process may use, the load average and the OS."""
    return {"cpu": hardware.cpu_model(), "cores": hardware.cpu_cores(),
            "load_average": load_average(), "platform": platform.platform()}


def provenance(command: str | Sequence[str] | None = None) -> dict[str, Any]:
    """The record: ``command`` (a string, or argv after the program: ``['bench', ...]`` is
    written ``ode-lm bench ...``; default this process's own argv), the commit, the UTC date
    and ``machine()``."""
    if command is None:
        command = sys.argv[1:]
    if not isinstance(command, str):
        command = shlex.join(["ode-lm", *command])
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"command": command, "commit": git_commit(),
            "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine()}
