"""``ode-lm <command> [flags]``: the one command in front of every ode-lm tool.

Dispatches to the module of each command (``ode_lm.commands.COMMANDS``) with
``prog="ode-lm <command>"``, so every message names the command the user typed. Exit status
of every command: 0 success; 2 the command line does not parse (unknown or abbreviated flag,
missing required flag, a value of the wrong type, a gin flag that does not parse, no
--gin_file); 1 the run failed (missing or bad file, bad value inside a config, a failed
run). Each error is one line on stderr, ``ode-lm <command>: error: ...``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from ode_lm import __version__, cli
from ode_lm.commands import COMMANDS

PROG = "ode-lm"


def help_text() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items())
    return f"""usage: {PROG} <command> [flags]    ({PROG} <command> --help: the command's flags)

Pretraining Neural ODE Transformers (DiffEqFormer) in JAX.

commands:
{rows}

options:
  -h, --help  show this message and exit
  --version   print the version and exit

exit status: 0 success; 1 the run failed (bad file or value, failed run); 2 the command line
does not parse. Errors are one line: {PROG} <command>: error: ...
"""


def _usage_error(message: str) -> int:
    print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
    return cli.EXIT_USAGE


def dispatch(argv: Sequence[str]) -> int:
    """Run ``argv[0]``'s command on the rest; the exit status."""
    if not argv:
        print(help_text(), end="", file=sys.stderr)
        return cli.EXIT_USAGE
    name, rest = argv[0], list(argv[1:])
    if name in ("-h", "--help"):
        print(help_text(), end="")
        return 0
    if name == "--version":
        print(f"{PROG} {__version__}")
        return 0
    if name.startswith("-"):
        return _usage_error(f"unknown option {name!r}")
    command = COMMANDS.get(name)
    if command is None:
        return _usage_error(f"unknown command {name!r}")
    prog = f"{PROG} {name}"
    # The one error wrapper: each command reports its own errors; one that escapes (an
    # optional extra missing at import, say) still ends as one line.
    return cli.run_command(prog, lambda: importlib.import_module(command.module).main(
        rest, prog=prog))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``ode-lm`` console script (and ``python -m ode_lm``)."""
    name = (sys.argv[1:] if argv is None else argv)[:1]
    if argv is None and name and name[0] in COMMANDS:
        cli.answer_ctrl_c_at_once(f"{PROG} {name[0]}")
    code = dispatch(list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        code = cli.exit_status(code)
    multi_host = bool(name) and name[0] in COMMANDS and COMMANDS[name[0]].multi_host
    if argv is None and multi_host and "jax" in sys.modules:  # jax not loaded: nothing ran
        from ode_lm import distributed

        distributed.exit_process(code)  # a multi-process CPU job's gloo teardown can hang
    if argv is None and code == cli.EXIT_INTERRUPTED and "jax" in sys.modules:
        # stopped by Ctrl-C, maybe inside an XLA compile or a worker thread: leave without
        # the interpreter's teardown, which could crash on their half-finished state
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
