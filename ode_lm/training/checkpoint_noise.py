"""Quiet orbax's own reports of a failed checkpoint save (and of a damaged step's failed
reads, whose other reads complete the same way after their loop is closed).

A failed background save (a full disk) is logged with its traceback by orbax (absl, from
several threads), by asyncio (its unretrieved write futures) and, through
``sys.unraisablehook``, by tensorstore completing the other writes after orbax closed their
event loop: about a thousand lines. ``Checkpointer`` reports the failure itself as one line
(``CheckpointSaveError``), so these are dropped; ``ODE_LM_DEBUG=1`` keeps them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any


def _from_orbax(tb: Any) -> bool:
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


# orbax writes a step under "<step>.orbax-checkpoint-tmp" until it is complete
SAVE_IN_PROGRESS = ".orbax-checkpoint-tmp"
# a read past the end of a truncated file of a saved step: the restore reports the step
# as damaged in one line and falls back, while asyncio logs each unretrieved read future
DAMAGED_READ = "is not valid for value of size"


class _OrbaxSaveNoise(logging.Filter):
    """A failed background save is logged with its traceback by orbax (absl, from several
    threads) and by asyncio (its unretrieved write futures): about a thousand lines for a
    full disk. The caller gets the error as one line (CheckpointSaveError), so records
    carrying an orbax exception, or the error of a write into a save in progress (which
    tensorstore raises with no orbax frame), are dropped unless ODE_LM_DEBUG is set."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or os.environ.get("ODE_LM_DEBUG"):
            return True
        _, exc, tb = record.exc_info
        return not (f"{os.sep}orbax{os.sep}" in record.pathname or _from_orbax(tb)
                    or SAVE_IN_PROGRESS in str(exc) or DAMAGED_READ in str(exc))


def _closed_loop_noise(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """sys.unraisablehook without the 'Event loop is closed' reports (tensorstore completing
    the other writes of a save whose first write failed, after orbax closed that event loop)
    nor the errors of orbax coroutines never awaited (the other reads of a damaged step)."""

    def unraisable(info: Any) -> None:
        closed = (isinstance(info.exc_value, RuntimeError)
                  and str(info.exc_value) == "Event loop is closed")
        ignored = closed or _from_orbax(getattr(info, "exc_traceback", None))
        if not ignored or os.environ.get("ODE_LM_DEBUG"):
            hook(info)

    unraisable.ode_lm_closed_loop = True
    return unraisable


def install_save_noise_filters() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxSaveNoise) for f in logger.filters):
            logger.addFilter(_OrbaxSaveNoise())
    if not getattr(sys.unraisablehook, "ode_lm_closed_loop", False):
        sys.unraisablehook = _closed_loop_noise(sys.unraisablehook)
