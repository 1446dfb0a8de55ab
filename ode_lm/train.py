"""``python -m ode_lm.train --gin_file=configs/runs/demo.gin [--gin.NAME=VALUE ...]``.

Thin CLI: flags → gin → :func:`ode_lm.training.gin_setup.train`. User errors (bad gin,
bad mesh, bad MODEL_DIR, incompatible checkpoint ...) print one line and exit 1. Ctrl-C:
the first saves at the next step boundary (``stopped by Ctrl-C after step k; checkpoint
saved``), a second stops at once (one line on stderr, no save); both exit 130.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# one_line / setup_logging / user_errors are imported from here by the other CLIs
from ode_lm.cli import main_exit, one_line, run_gin_cli, setup_logging, user_errors  # noqa: F401

USAGE = (
    "usage: python -m ode_lm.train --gin_file=FILE [--gin_file=...] [--gin.NAME=VALUE ...] "
    "[--gin_bindings='A.b = v'] [--gin_search_paths=DIR,...] [--verbose]"
)


def report(result) -> int:
    """The run summary on stdout (process 0 prints). A run stopped early or with nothing to
    train has said so in its one line already: exit 130 after Ctrl-C (the user's stop, so
    ``train && eval`` stops too), else 0 (SIGTERM: the scheduler reruns the command)."""
    if result.preempted or result.nothing_to_train:
        return 130 if result.stopped_by == "Ctrl-C" else 0
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


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm-train") -> int:
    from ode_lm.training import gin_setup

    return run_gin_cli(argv, prog=prog, usage=USAGE, entry=gin_setup.train, report=report)


if __name__ == "__main__":
    main_exit(main)
