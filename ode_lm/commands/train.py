"""``ode-lm train --gin_file=configs/runs/demo.gin [--gin.NAME=VALUE ...]``
(also ``python -m ode_lm.commands.train``, ``ode-lm-train``).

Thin CLI: flags → gin → :func:`ode_lm.gin_setup.train`. User errors print one line
and exit 2 (a command line that does not parse) or 1 (bad gin value, bad mesh, bad MODEL_DIR,
incompatible checkpoint ...). Ctrl-C: the first saves at the next step boundary (``stopped by
Ctrl-C after step k; checkpoint saved``), a second stops at once (one line on stderr, no
save); both exit 130.
"""

from __future__ import annotations

from collections.abc import Sequence

from ode_lm.cli import main_exit, run_gin_cli

DESCRIPTION = (
    "Pretrain a model from gin configs: mesh, model, data, optimizer, checkpoints and metrics "
    "all come from the files (configs/runs/*.gin). Resumes from MODEL_DIR's latest checkpoint."
)
EXAMPLE = """examples:
  ode-lm train --gin_file=configs/runs/demo.gin
  ode-lm train --gin_file=configs/runs/demo.gin --gin.TRAIN_STEPS=100 --gin.MODEL_DIR=/tmp/run
  ode-lm train --gin_file=configs/runs/demo.gin --help    # also lists the macros it defines"""


def report(result) -> int:
    """The run summary on stdout (process 0 prints). A run stopped early or with nothing to
    train has said so in its one line already: exit 130 after Ctrl-C (the user's stop, so
    ``train && eval`` stops too), else 0 (SIGTERM: the scheduler reruns the command)."""
    from ode_lm.training.run_dir import RunDir

    if result.preempted or result.nothing_to_train:
        return 130 if result.stopped_by == "Ctrl-C" else 0
    summary = [f"model dir: {result.model_dir}",
               f"checkpoints: {RunDir(result.model_dir).checkpoints}",
               f"tensorboard: tensorboard --logdir {result.model_dir}",
               f"steps: {result.step}"]
    if result.first_loss is not None:
        summary.append(f"first logged train loss: {result.first_loss:.4f}")
    # the final eval: an ODE run's settings as one table, every other figure as a line
    from ode_lm.training.summary import depth_table

    table, shown = depth_table(result.eval, result.eval_settings)
    summary += [f"{k}: {v:.4f}" for k, v in result.eval.items() if k not in shown] + table
    print("\n".join(summary))
    write_summary(result)
    return 0


def write_summary(result) -> None:
    """``summary.json`` in the run directory: the final eval, its settings and where they came
    from, so a table of the docs is regenerated from the run, not copied from a terminal."""
    import dataclasses

    import jax

    from ode_lm.provenance import provenance
    from ode_lm.training.run_dir import RunDir

    if jax.process_index() != 0:  # one writer of a shared run directory
        return
    RunDir(result.model_dir).write_summary({
        "provenance": provenance(),
        "model_dir": str(result.model_dir), "steps": int(result.step),
        "eval": {k: float(v) for k, v in result.eval.items()},
        "settings": {k: dataclasses.asdict(v) for k, v in result.eval_settings.items()}})


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm-train") -> int:
    def entry():
        from ode_lm import gin_setup  # imported once the flags parse (not for --help)

        return gin_setup.train()

    return run_gin_cli(argv, prog=prog, entry=entry, report=report,
                       description=DESCRIPTION, example=EXAMPLE)


if __name__ == "__main__":
    main_exit(main)
