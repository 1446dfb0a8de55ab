"""One training run per MODEL_DIR, and no half-made MODEL_DIR after a failed start.

``hold(model_dir)`` (the trainer's ``run``) takes the run lock (``RunDir.lock``) before
anything is written there: an exclusive ``flock`` on the file, whose text names the holder
(pid, host, start time). A second run on the same directory stops at once with one line naming the
holder, and changes nothing there. The kernel drops a ``flock`` when its process dies, so a
lock file left by a dead run on this host is taken over with a warning; one naming another
host is refused (its pid cannot be checked from here), with the file to delete if that run
is gone. Only process 0 of a multi-host job takes the lock. The lock is released (the file
removed) on a normal exit, on errors and on the SIGTERM (preemption) exit.

When the run fails before its first complete checkpoint and MODEL_DIR did not exist (or was
empty) before it, what this run created is removed again; a directory that already held
anything is never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator

from ode_lm.training.run_dir import RunDir

log = logging.getLogger("ode_lm.train")


class RunLockedError(RuntimeError):
    """MODEL_DIR is held by another live training run."""


@dataclasses.dataclass
class RunDirLock:
    """A held lock on MODEL_DIR, and what this run created there."""

    model_dir: str
    path: str
    fd: int
    created: str | None  # topmost directory this run made (None: MODEL_DIR existed)
    was_empty: bool  # MODEL_DIR existed with nothing in it

    def release(self, failed: bool = False, quiet: bool = False) -> None:
        """Drop the lock; after a failure before the first checkpoint, also remove what this
        run created (only where MODEL_DIR was new or empty; ``quiet``: without a warning,
        when the stop's own line says it, as a second Ctrl-C's does)."""
        try:
            new = self.created or self.was_empty
            if failed and new and not RunDir(self.model_dir).has_checkpoint():
                _remove_created(self, quiet)
                return
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    os.remove(self.path)
        finally:
            os.close(self.fd)


def first_missing(path: str) -> str | None:
    """The topmost ancestor of ``path`` (or itself) that does not exist yet."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _remove_created(lock: RunDirLock, quiet: bool = False) -> None:
    if lock.created:
        # a start that wrote nothing but its lock (a bad config found by the data step) has
        # nothing to report beyond its own error line
        wrote = set(os.listdir(lock.model_dir)) - {os.path.basename(lock.path)}
        shutil.rmtree(lock.created, ignore_errors=True)
        if wrote and not quiet:
            log.warning("removed %s: the run failed before its first checkpoint", lock.created)
        return
    for name in os.listdir(lock.model_dir):  # was empty before this run: all of it is ours
        p = os.path.join(lock.model_dir, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.remove(p)


def _holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode(errors="replace")
    try:
        info = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        info = {"raw": text.strip()[:80]}
    return info if isinstance(info, dict) else {"raw": str(info)[:80]}


def _describe(info: dict) -> str:
    if "pid" not in info:
        return f"unknown holder ({info.get('raw', 'empty lock file')!r})"
    return f"pid {info['pid']} on host {info.get('host', '?')}, since {info.get('started', '?')}"


def acquire(model_dir: str) -> RunDirLock:
    """Take MODEL_DIR's run lock (making MODEL_DIR if needed); RunLockedError if held."""
    created = first_missing(model_dir)
    was_empty = created is None and os.path.isdir(model_dir) and not os.listdir(model_dir)
    path = RunDir(model_dir).lock
    try:
        os.makedirs(model_dir, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _holder(fd)
                os.close(fd)
                raise RunLockedError(
                    f"MODEL_DIR={model_dir!r} is in use by another training run "
                    f"({_describe(info)}; lock {path}): stop it or choose another MODEL_DIR"
                ) from None
            try:  # the holder may have removed the file between our open and flock
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
    except OSError as e:
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise PermissionError(f"MODEL_DIR={model_dir!r} is not writable: {e.strerror}") from None
    info, host = _holder(fd), socket.gethostname()
    if info.get("host") not in (None, host):
        os.close(fd)  # another host's run: its pid cannot be checked from here
        raise RunLockedError(
            f"MODEL_DIR={model_dir!r} is locked by a run on another host ({_describe(info)}); "
            f"if that run is gone, delete {path} and rerun"
        )
    if info:
        log.warning("taking over the run lock %s left by a process that is gone (%s)",
                    path, _describe(info))
    me = {"pid": os.getpid(), "host": host,
          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    os.fsync(fd)
    return RunDirLock(model_dir, path, fd, created, was_empty)


@contextlib.contextmanager
def hold(model_dir: str, primary: bool = True) -> Iterator[RunDirLock | None]:
    """The run lock for the body's duration (a no-op on processes other than 0, and on
    object-store paths such as ``gs://``, which have no ``flock``)."""
    if not primary or "://" in model_dir:
        if primary:
            log.warning("no run lock for MODEL_DIR=%s: only local and mounted file systems "
                        "can be locked", model_dir)
        yield None
        return
    lock = acquire(model_dir)
    try:
        yield lock
    except BaseException as e:
        lock.release(failed=True, quiet=isinstance(e, KeyboardInterrupt))
        raise
    lock.release()
