"""``python -m ode_lm.train --gin_file=configs/runs/demo.gin [--gin.NAME=VALUE ...]``.

Thin CLI: flags → gin → :func:`ode_lm.training.gin_setup.train`. User errors (bad gin,
bad mesh, bad MODEL_DIR, incompatible checkpoint ...) print one line and exit 1.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

USAGE = (
    "usage: python -m ode_lm.train --gin_file=FILE [--gin_file=...] [--gin.NAME=VALUE ...] "
    "[--gin_bindings='A.b = v'] [--gin_search_paths=DIR,...]"
)


def one_line(e: BaseException) -> str:
    """Exception text collapsed to one line (gin appends its file location on new lines)."""
    if isinstance(e, SyntaxError) and e.filename:
        text = (e.text or "").strip()
        return f"{e.msg} ({e.filename}, line {e.lineno}: {text!r})"
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    return text or type(e).__name__


def user_errors() -> tuple[type[BaseException], ...]:
    from ode_lm.data.prepare import PreparedDataError

    return (ValueError, TypeError, OSError, RuntimeError, KeyError, FloatingPointError,
            SyntaxError, PreparedDataError)


class _GinSearchNoise(logging.Filter):
    """gin logs an ERROR for every search path a config file is *not* in; drop those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Path not found")


def setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    root = logging.getLogger()
    if not any(isinstance(f, _GinSearchNoise) for f in root.filters):
        root.addFilter(_GinSearchNoise())
    logging.getLogger("ode_lm").setLevel(logging.INFO)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm-train") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    setup_logging()
    from ode_lm.training import gin_setup

    try:
        # Multi-host: joins the job before any JAX computation (auto on TPU pods; explicit
        # via JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); no-op alone.
        from ode_lm import distributed

        distributed.initialize()
        flags = gin_setup.parse_flags(argv)
        if flags.rest:
            raise ValueError(f"unknown flag {flags.rest[0]!r}; {USAGE}")
        if not flags.files and not flags.bindings:
            raise ValueError(f"no configuration given; {USAGE}")
        gin_setup.parse_gin(flags)
        result = gin_setup.train()
    except user_errors() as e:
        if os.environ.get("ODE_LM_DEBUG"):
            raise
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 1
    if result.preempted:
        print(f"{prog}: stopped by SIGTERM after step {result.step}; checkpoint saved")
        return 0
    summary = [f"model dir: {result.model_dir}",
               f"checkpoints: {os.path.join(result.model_dir, 'checkpoints')}",
               f"tensorboard: tensorboard --logdir {result.model_dir}",
               f"steps: {result.step}"]
    if result.first_loss is not None:
        summary.append(f"first logged train loss: {result.first_loss:.4f}")
    for k, v in result.eval.items():
        summary.append(f"{k}: {v:.4f}")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    from ode_lm import distributed

    distributed.exit_process(main())
