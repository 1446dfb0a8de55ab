"""The ``ode-lm`` subcommands: name → module and one-line summary.

Each module exposes ``main(argv, prog) -> int`` (exit status) and imports its heavy pieces
(jax, gin, the trainer) inside, so ``ode-lm --help`` and the dispatch stay instant.
Every command's module lives here (``python -m ode_lm.commands.train`` runs one directly);
the non-core ones are the former ``tools/*.py`` scripts.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Command:
    module: str
    summary: str
    multi_host: bool = False  # leaves through distributed.exit_process (gloo teardown)


COMMANDS: dict[str, Command] = {
    "train": Command("ode_lm.commands.train", "pretrain a model from gin configs (resumes "
                     "MODEL_DIR)", multi_host=True),
    "finetune": Command("ode_lm.commands.finetune", "fine-tune a pretrained run at another "
                        "depth M, fully or with LoRA", multi_host=True),
    "eval": Command("ode_lm.commands.eval", "loss and perplexity of a saved run at any "
                    "steps/solver, or lm-eval tasks"),
    "sample": Command("ode_lm.commands.sample", "generate text from a saved run (KV-cached ODE "
                      "solve)"),
    "prepare": Command("ode_lm.commands.prepare", "tokenize raw text into ArrayRecord shards "
                       "and a manifest (resumable)"),
    "export": Command("ode_lm.commands.export", "export a checkpoint: raw safetensors, or "
                      "Hugging Face at M Euler steps"),
    "analyze": Command("ode_lm.commands.analyze", "trajectories, eigen-spectra, token Lyapunov "
                       "exponents of a trained model"),
    "depth-report": Command("ode_lm.commands.depth_report", "perplexity at every step count and "
                            "solver, W(t) smoothness"),
    "depth-gap": Command("ode_lm.commands.depth_gap", "the depth gap over training, from runs' "
                         "metrics: markdown table or plot"),
    "aot": Command("ode_lm.commands.aot", "compile the train step for a TPU topology here: "
                   "memory fit, FLOPs, MFU"),
    "bench": Command("ode_lm.commands.bench", "time the train step: ODE vs vanilla, variants, "
                     "checkpoints, solvers"),
    "sweep": Command("ode_lm.commands.sweep", "expand a scaling sweep into runs: list, train "
                     "here, or TPU launch lines"),
    "scaling-report": Command("ode_lm.commands.scaling_report", "eval loss against training "
                              "FLOPs per step count, with power-law fits"),
    "finetune-table": Command("ode_lm.commands.finetune_table", "the adaptive-depth table: "
                              "pretrain, fine-tune at each M, perplexities"),
    "reproduce": Command("ode_lm.commands.reproduce", "the paper's findings as claims: runs, "
                         "one statistic per seed, a verdict each"),
}
