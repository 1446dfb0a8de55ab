"""Stopping a run between steps: SIGTERM, Ctrl-C and a pod's preemption sync point become
'stop after this step' (the trainer saves, then exits); a second Ctrl-C stops at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp


class PreemptionWatcher:
    """Turns SIGTERM, Ctrl-C (SIGINT) and JAX's preemption sync point on pods into a 'stop
    after this step' (the trainer then saves); a second Ctrl-C stops at once by raising
    :class:`StopNow` wherever the loop is, so nothing more is saved."""

    SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}

    def __init__(self):
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self._interruptible = False  # inside the final eval: a first Ctrl-C ends it at once
        self.reason: str | None = None  # "SIGTERM", "Ctrl-C" or "preemption"

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Work after the last checkpoint (the final eval): a first Ctrl-C stops it at once,
        raising :class:`StopEval` there, instead of after it (a minute of no reply). One
        process only: a pod's processes would leave each other in a collective."""
        if jax.process_count() > 1:
            yield
            return
        if self.reason == "Ctrl-C":  # pressed since the watcher last looked: not begun
            raise StopEval()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def install(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.reason == "Ctrl-C":
            raise StopNow()
        self.reason = self.reason or self.SIGNALS[signum]
        self._event.set()
        if signum == signal.SIGINT and self._interruptible:
            self._interruptible = False
            raise StopEval()

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def __enter__(self) -> PreemptionWatcher:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __call__(self, info: Any) -> None:
        """The trainer's hook, every step (``hooks.StepInfo``): a stop asked for becomes
        ``info.stopped_by``, so the hooks after it save and the loop ends after this step."""
        if self.should_stop(info.step):
            info.stopped_by = self.reason

    def should_stop(self, step: int) -> bool:
        if self._event.is_set():
            return True
        # orbax's check of JAX's preemption sync point (the one the checkpoint manager's
        # save decision uses; False when the preemption service is not running)
        if jax.process_count() > 1 and ocp.multihost.reached_preemption(step):
            self.reason = "preemption"
            return True
        return False


class StopNow(KeyboardInterrupt):  # noqa: N818 - a KeyboardInterrupt, named for what it does
    """A second Ctrl-C: stop at once, without a save (the CLI prints ``str(self)``)."""


class StopEval(KeyboardInterrupt):  # noqa: N818 - a KeyboardInterrupt, named for what it does
    """A first Ctrl-C during the final eval: the eval ends at once (the checkpoint of the
    last step is saved already); a rerun of the command runs the eval it skipped."""
