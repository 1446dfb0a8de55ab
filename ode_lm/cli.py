"""What every ode-lm CLI shares: one-line errors, logging set-up and the gin CLI runner.

A user error ends a command with exactly one line ``<prog>: error: <message>`` on stderr and
exit status 2 for a command line that does not parse (unknown or abbreviated flag, missing
required flag, a value of the wrong type, a gin flag that does not parse, no --gin_file) or
a setting a config class refuses when it is built (``errors.SettingError``: a field's value,
from a flag or a file), or 1 for a run that fails (missing or bad file, settings that do
not fit the machine or the data, a failed run).
``--verbose`` (or ``ODE_LM_DEBUG=1``, which also re-raises for the traceback) keeps gin's full
message.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ode_lm.errors import SettingError, UsageError

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


EXIT_FAILURE = 1  # the run failed: bad file, settings that do not fit, failed run
EXIT_USAGE = 2  # the command line does not parse, or a config class refuses a setting


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a CLI reports as one line (anything else is a bug: traceback).
    ImportError: an optional extra that is not installed (``.[hf]``, ``.[lmeval]``)."""
    return (ValueError, TypeError, OSError, RuntimeError, KeyError, FloatingPointError,
            SyntaxError, ImportError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line error of every ode-lm CLI (no usage block before it) and
    no abbreviated flags (``--num_step`` is not ``--num_steps``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _list_type(item: Callable[[str], Any], name: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = []
        for part in text.split(","):
            try:
                values.append(item(part.strip()))
            except ValueError:
                where = f" (in {text!r})" if "," in text else ""
                raise argparse.ArgumentTypeError(
                    f"invalid {name} value: {part.strip()!r}{where}") from None
        return values

    parse.__name__ = f"{name} list"
    return parse


int_list = _list_type(int, "int")  # argparse type for '2,4,8'; the error names flag and entry
float_list = _list_type(float, "float")


def check_solver_flags(solver: str | None, rtol: float | None, atol: float | None, *,
                       flag: str = "--solver") -> None:
    """``--solver`` / ``--rtol`` / ``--atol`` of the commands that solve a saved run (eval,
    sample, depth-report), checked before anything is restored: a bad value is a usage error
    (exit 2) naming ``flag``, the flag the user typed (``--solvers`` for a list)."""
    from ode_lm.models import solvers as solvers_lib

    if solver is not None:
        try:
            solvers_lib.check_solver(solver, adaptive_ok=True)
        except ValueError as e:
            raise UsageError(f"{flag}={solver!r}: {str(e).partition(': ')[2]}") from None
    if rtol is not None and not rtol > 0:
        raise UsageError(f"--rtol={rtol}: must be > 0")
    if atol is not None and not atol >= 0:
        raise UsageError(f"--atol={atol}: must be >= 0")


def check_tolerances_used(solver: str | None, rtol: float | None, atol: float | None,
                          model_dir: str | None = None) -> None:
    """``--rtol``/``--atol`` set only an adaptive solve: with a fixed-grid ``--solver`` (or,
    without one, a run whose own solver is fixed-grid, read from its model config) they
    would be ignored without a word, so they are refused in one line, before a restore."""
    if rtol is None and atol is None:
        return
    from ode_lm.models import solvers as solvers_lib

    whose = f"--solver={solver}"
    if solver is None and model_dir is not None:
        from ode_lm.training.run_dir import RunDir

        try:
            solver, whose = RunDir(model_dir).model_config().solver, "the run's own solver"
        except (OSError, ValueError, TypeError):
            return  # no readable run: the restore says so
    if solver is None or solvers_lib.is_adaptive(solver):
        return
    flag = f"--rtol={rtol}" if rtol is not None else f"--atol={atol}"
    raise UsageError(f"{flag}: {whose} ({solver}) is fixed-grid and takes no tolerance; "
                     "add --solver=adaptive (or dopri5) to solve adaptively")


def check_out_dir(path: str, flag: str = "--out") -> None:
    """A directory flag that names an existing file: one line naming it, before any work
    (``os.makedirs`` would say only ``[Errno 17] File exists``)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{flag}={path}: is a file, not a directory")


def check_out_file(path: str, flag: str = "--json") -> None:
    """An output file flag, before any work: one that names a directory, or lies in a
    directory that does not exist, is one line naming it (``open`` would fail only after
    the work, with a bare ``[Errno 21]``)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{flag}={path}: is a directory, not a file")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{flag}={path}: directory {parent} does not exist")


_RST_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(doc: str) -> str:
    """A docstring as a terminal shows it: reST literals (double backticks) unmarked."""
    return _RST_LITERAL.sub(r"\1", doc)


def doc_parser(prog: str, doc: str) -> ArgumentParser:
    """A command's parser from its module docstring: the first paragraph is the description,
    the rest (usage examples, notes) the epilog, printed as written."""
    head, _, rest = plain_text(doc).partition("\n\n")
    return ArgumentParser(prog=prog, description=head, epilog=rest,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


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


def report_error(prog: str, e: BaseException, verbose: bool = False) -> int:
    """The one error line on stderr; the exit status: 2 for a UsageError (a refused setting
    names its field and value: no pointer to --help), else 1."""
    if debug():
        raise e
    if isinstance(e, SettingError):
        print(f"{prog}: error: {one_line(e, verbose)}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, UsageError):
        print(f"{prog}: error: {one_line(e, verbose)} (see --help)", file=sys.stderr)
        return EXIT_USAGE
    print(f"{prog}: error: {one_line(e, verbose)}", file=sys.stderr)
    return EXIT_FAILURE


def run_command(prog: str, body: Callable[[], int | None], *, verbose: bool = False,
                errors: tuple[type[BaseException], ...] = ()) -> int:
    """The one error wrapper of every command: ``body()``'s exit status, or, for a user error
    (``user_errors()`` plus ``errors``), one line on stderr and 2 (usage) or 1 (run time)."""
    try:
        return int(body() or 0)
    except (*user_errors(), *errors) as e:
        return report_error(prog, e, verbose)
    except KeyboardInterrupt as e:  # Ctrl-C: one line, no traceback, 130
        return report_interrupt(prog, e)


EXIT_INTERRUPTED = 130


def report_interrupt(prog: str, e: BaseException | None = None) -> int:
    """Ctrl-C, for every command: one stderr line (the interrupt's own words when it has
    any: the trainer's second press names the latest checkpoint), exit 130. Said once when
    wrappers nest (the dispatcher's around the command's own) or when the Ctrl-C thread
    already answered."""
    if debug():
        raise e if e is not None else KeyboardInterrupt
    global _interrupt_reported
    with _interrupt_lock:
        if not _interrupt_reported:
            _interrupt_reported = True
            text = str(e) if e is not None and str(e) else _ctrl_c_text
            print(f"{prog}: {text}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


_interrupt_reported = False
_interrupt_lock = threading.Lock()
_ctrl_c_text = "stopped by Ctrl-C"
_ctrl_c_pressed = threading.Event()


def answer_ctrl_c_at_once(prog: str) -> None:
    """Reply to Ctrl-C the moment it is pressed, even while the main thread is inside a long
    XLA compile or call (Python runs a signal handler only between the main thread's
    bytecodes): the signal's wakeup byte wakes a thread that prints the one line; the main
    thread stops with KeyboardInterrupt at its next bytecode, and ``report_interrupt`` does
    not repeat the line. The handler notes the press first, so ``exit_status`` is 130 even
    when something swallows the KeyboardInterrupt. Only where Ctrl-C has Python's default
    handler: a job started in the background keeps ignoring it, and the trainer's own
    handler (stop after this step, then save) answers for itself. The console script calls
    this once; a no-op off the main thread."""
    global _prog
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:
        return
    _prog = prog
    signal.signal(signal.SIGINT, _on_ctrl_c)

    def watch() -> None:
        while data := os.read(read, 64):
            if signal.SIGINT in data and signal.getsignal(signal.SIGINT) is _on_ctrl_c:
                _ctrl_c_pressed.set()
                report_interrupt(prog)

    threading.Thread(target=watch, name="ctrl-c", daemon=True).start()


def _on_ctrl_c(signum: int, frame: Any) -> None:
    """Python's default Ctrl-C (KeyboardInterrupt), the press noted first."""
    _ctrl_c_pressed.set()
    raise KeyboardInterrupt


_prog: str | None = None


def ctrl_c_text(text: str) -> None:
    """What a Ctrl-C outside any handler of the command's own says from now on (the gin
    CLIs: nothing more saved, outside the train loop)."""
    global _ctrl_c_text
    _ctrl_c_text = text


def exit_status(code: int) -> int:
    """130 once Ctrl-C was pressed, with its one line said, even if the interrupt never
    reached the command (a library swallowed it, or the work ended first)."""
    if not _ctrl_c_pressed.is_set():
        return code
    return report_interrupt(_prog or "ode-lm")


def gin_parser(prog: str, description: str, example: str) -> ArgumentParser:
    """The help of a gin CLI (train, finetune): its flags as argparse shows them. The flags
    themselves are read by ``gin_setup.parse_flags`` (``--gin.NAME=VALUE`` is not a
    flag argparse can parse)."""
    p = ArgumentParser(prog=prog, description=textwrap.fill(description, 88), epilog=example,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gin_file", metavar="FILE", action="append",
                   help="a gin config (repeatable; parsed in order, later values win; its "
                        "'include' lines are followed); looked up as given, then in "
                        "--gin_search_paths and the package's configs/. With --help: also "
                        "list the macros the files define")
    p.add_argument("--gin.NAME=VALUE", dest="gin_shorthand", action="store_true",
                   help="bind a macro (--gin.TRAIN_STEPS=100) or a parameter "
                        "(--gin.ModelConfig.solver=rk4) after the files; a bare word VALUE is "
                        "a string")
    p.add_argument("--gin_bindings", metavar="'A.b = v'", action="append",
                   help="a gin binding line (repeatable), after the files")
    p.add_argument("--gin_search_paths", metavar="DIR,...",
                   help="more directories to look up --gin_file and 'include' in")
    p.add_argument("--verbose", action="store_true",
                   help="debug logging, and gin's full error text (ODE_LM_DEBUG=1: traceback)")
    return p


def _gin_help(parser: ArgumentParser, argv: list[str], prog: str, verbose: bool) -> int:
    """``--help``: the parser's help; with --gin_file also the macros those files (their
    includes, and the command line's bindings) define, with their values."""
    text = parser.format_help()
    if not any(a.startswith("--gin_file") for a in argv):  # no files: no gin (nor jax) import
        print(text, end="")
        return 0
    from ode_lm import gin_setup

    flags = gin_setup.parse_flags([a for a in argv if a not in ("-h", "--help")])
    if flags.files:
        gin_setup.parse_gin(flags)
        macros = gin_setup.macro_values()
        width = max((len(k) for k in macros), default=0)
        lines = [f"  {name:<{width}} = {value}" for name, value in macros.items()]
        text += (f"\nmacros of {', '.join(flags.files)} (set one with --gin.NAME=VALUE):\n"
                 + ("\n".join(lines) if lines else "  (none)") + "\n")
    print(text, end="")
    return 0


def run_gin_cli(
    argv: Sequence[str] | None,
    *,
    prog: str,
    entry: Callable[[], Any],
    report: Callable[[Any], int],
    description: str = "",
    example: str = "",
    require_files: bool = False,
) -> int:
    """The gin CLIs (train, finetune): flags → gin → checks → multi-host join → ``entry()``.

    Gin typos (unknown configurable, parameter or macro) stop before any work; then the job
    joins its peers (``distributed.initialize``, a no-op alone) and runs ``entry()``, whose
    result ``report`` prints. Leave through :func:`main_exit`.
    """
    argv, verbose = pop_verbose(list(sys.argv[1:] if argv is None else argv))
    setup_logging(verbose)
    if any(a in ("-h", "--help") for a in argv):
        parser = gin_parser(prog, description, example)
        return run_command(prog, lambda: _gin_help(parser, argv, prog, verbose), verbose=verbose)
    from ode_lm import distributed, gin_setup

    said = _ctrl_c_text
    ctrl_c_text("stopped by Ctrl-C outside the train loop; nothing more saved")
    try:
        flags = gin_setup.parse_flags(argv)
        if flags.rest:
            raise UsageError(f"unknown flag {flags.rest[0]!r}")
        if not flags.files and (require_files or not flags.bindings):
            raise UsageError("no configuration given: pass --gin_file=FILE")
        gin_setup.parse_gin(flags)
        gin_setup.check_cli_macros(flags)
        # Multi-host: joins the job before any JAX computation (auto on TPU pods; explicit
        # via JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); no-op alone.
        distributed.initialize(config=gin_setup.GinDistributedConfig())
        result = entry()
    except user_errors() as e:
        distributed.wait_for_lost_peer(e)  # a failed collective: name the lost host instead
        return report_error(prog, e, verbose)
    except KeyboardInterrupt as e:  # a second Ctrl-C (the trainer's StopNow), or one outside
        return report_interrupt(prog, e if str(e) else None)  # the loop: one line
    finally:
        ctrl_c_text(said)
    return report(result)


def main_exit(main: Callable[[], int]) -> None:
    """How a CLI module leaves: ``distributed.exit_process`` (a multi-process CPU job's gloo
    teardown can hang at interpreter exit)."""
    from ode_lm import distributed

    distributed.exit_process(exit_status(main()))
