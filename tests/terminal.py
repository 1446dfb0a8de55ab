"""A child process that has Ctrl-C as a terminal's foreground job does."""

from __future__ import annotations

import signal


def foreground() -> None:
    """``preexec_fn`` of a Ctrl-C test's child: SIGINT at its default, whatever the test run
    was started with. A job started in the background (``cmd &`` in a script, as CI may do)
    ignores SIGINT and its children inherit that; Python then never installs its
    KeyboardInterrupt handler, and a Ctrl-C test would wait on a process that cannot hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
