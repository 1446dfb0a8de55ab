"""``ode-lm finetune --gin_file=configs/finetune/X.gin [--gin.NAME=VALUE ...]``: the CLI of
adaptive-depth fine-tuning (``ode_lm.finetune``), through the same gin runner as train."""

from __future__ import annotations

from collections.abc import Sequence

from ode_lm.cli import main_exit, run_gin_cli

DESCRIPTION = (
    "Fine-tune a pretrained run at another depth M (FINETUNE_STEPS), fully or with LoRA "
    "(METHOD), as a continuous ODE or materialised into M layers (FinetuneConfig.mode); "
    "the pretrained run is PRETRAINED_DIR, the new one MODEL_DIR."
)
EXAMPLE = """examples:
  ode-lm finetune --gin_file=configs/finetune/demo.gin --gin.PRETRAINED_DIR=/tmp/run \\
      --gin.MODEL_DIR=/tmp/ft --gin.FINETUNE_STEPS=6 --gin.METHOD=lora
  ode-lm finetune --gin_file=configs/finetune/demo.gin --help    # also lists its macros"""


def report(outcome) -> int:
    result, _ = outcome
    for k, v in result.eval.items():
        print(f"{k}: {v:.4f}")
    return 130 if result.stopped_by == "Ctrl-C" else 0


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm-finetune") -> int:
    """Same runner as ``ode-lm train``: gin checks, then the multi-host join, then the run."""

    def entry():
        from ode_lm import gin_setup  # imported once the flags parse (not for --help)
        from ode_lm.training.inputs import data_dirs_kept_as_found

        model_dir = gin_setup.query("finetune.model_dir")
        while str(model_dir).startswith("%"):  # a macro (MODEL_DIR): its value
            model_dir = gin_setup.query(str(model_dir))
        # a fine-tune refused before its first checkpoint (another tokenizer than the
        # pretrained run's) leaves no data dir prepared with the refused settings
        with data_dirs_kept_as_found(gin_setup.GinDataConfig(), str(model_dir)):
            return gin_setup.finetune()

    return run_gin_cli(argv, prog=prog, entry=entry, report=report,
                       description=DESCRIPTION, example=EXAMPLE, require_files=True)


if __name__ == "__main__":
    main_exit(main)
