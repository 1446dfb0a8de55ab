"""What every ode-lm CLI shares: one-line errors, logging set-up and the gin CLI runner.

A user error (bad flag, gin typo, bad value, missing file ...) ends a CLI with exit code 1 and
exactly one line ``<prog>: error: <message>`` on stderr. ``--verbose`` (or
``ODE_LM_DEBUG=1``, which also re-raises for the traceback) keeps gin's full message.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

# gin appends "  In call to configurable 'X' (<class '...'>)" (or "<function ... at 0x..>")
# to every exception raised inside a configurable; one per level of nesting.
_GIN_CALL_SUFFIX = re.compile(r"\s*In call to configurable '[^']*' \(<[^>]*>\)")


def one_line(e: BaseException, verbose: bool = False) -> str:
    """Exception text collapsed to one line, without gin's call-site suffix unless verbose."""
    if isinstance(e, SyntaxError) and e.filename:
        text = (e.text or "").strip()
        return f"{e.msg} ({e.filename}, line {e.lineno}: {text!r})"
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    if not verbose:
        text = _GIN_CALL_SUFFIX.sub("", text).strip()
    return text or type(e).__name__


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a CLI reports as one line (anything else is a bug: traceback)."""
    from ode_lm.data.prepare import PreparedDataError

    return (ValueError, TypeError, OSError, RuntimeError, KeyError, FloatingPointError,
            SyntaxError, PreparedDataError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line error of every ode-lm CLI (no usage block before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def debug() -> bool:
    return bool(os.environ.get("ODE_LM_DEBUG"))


class _GinSearchNoise(logging.Filter):
    """gin logs an ERROR for every search path a config file is *not* in; drop those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Path not found")


def setup_logging(verbose: bool = False) -> None:
    """Warnings to stderr; ode_lm's own progress at INFO (DEBUG with --verbose)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    root = logging.getLogger()
    if not any(isinstance(f, _GinSearchNoise) for f in root.filters):
        root.addFilter(_GinSearchNoise())
    logging.getLogger("ode_lm").setLevel(logging.DEBUG if verbose else logging.INFO)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass


def pop_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """(argv without --verbose, whether it was given); ODE_LM_DEBUG implies verbose."""
    rest = [a for a in argv if a != "--verbose"]
    return rest, len(rest) != len(argv) or debug()


def report_error(prog: str, e: BaseException, verbose: bool) -> int:
    if debug():
        raise e
    print(f"{prog}: error: {one_line(e, verbose)}", file=sys.stderr)
    return 1


def run_gin_cli(
    argv: Sequence[str] | None,
    *,
    prog: str,
    usage: str,
    entry: Callable[[], Any],
    report: Callable[[Any], int],
    require_files: bool = False,
) -> int:
    """The gin CLIs (train, finetune): flags → gin → checks → multi-host join → ``entry()``.

    Gin typos (unknown configurable, parameter or macro) stop before any work; then the job
    joins its peers (``distributed.initialize``, a no-op alone) and runs ``entry()``, whose
    result ``report`` prints. Leave through :func:`main_exit`.
    """
    argv, verbose = pop_verbose(list(sys.argv[1:] if argv is None else argv))
    if any(a in ("-h", "--help") for a in argv):
        print(usage)
        return 0
    setup_logging(verbose)
    from ode_lm import distributed
    from ode_lm.training import gin_setup

    try:
        flags = gin_setup.parse_flags(argv)
        if flags.rest:
            raise ValueError(f"unknown flag {flags.rest[0]!r}; {usage}")
        if not flags.files and (require_files or not flags.bindings):
            raise ValueError(f"no configuration given (--gin_file=...); {usage}")
        gin_setup.parse_gin(flags)
        gin_setup.check_cli_macros(flags)
        # Multi-host: joins the job before any JAX computation (auto on TPU pods; explicit
        # via JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); no-op alone.
        distributed.initialize()
        result = entry()
    except user_errors() as e:
        distributed.wait_for_lost_peer(e)  # a failed collective: name the lost host instead
        return report_error(prog, e, verbose)
    except KeyboardInterrupt as e:  # a second Ctrl-C (the trainer's StopNow), or one outside
        print(f"{prog}: {e or 'stopped by Ctrl-C outside the train loop; nothing more saved'}",
              file=sys.stderr)  # the loop: one line, no traceback
        return 130
    return report(result)


def main_exit(main: Callable[[], int]) -> None:
    """How a CLI module leaves: ``distributed.exit_process`` (a multi-process CPU job's gloo
    teardown can hang at interpreter exit)."""
    from ode_lm import distributed

    distributed.exit_process(main())
