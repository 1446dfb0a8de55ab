"""The README's adaptive-depth table: pretrain cpu_small at 6 steps, fine-tune at M steps.

  ode-lm finetune-table [--pretrain_steps=60] [--finetune_steps=15] [--depths=3,6,12]

1. pretrains ``configs/finetune/pretrain_demo.gin`` (built-in corpus, 30% of documents held
   out) unless its checkpoint exists;
2. writes the held-out documents to a jsonl (the data module's own hold-out rule);
3. fine-tunes ``configs/finetune/demo.gin`` at each M, full and LoRA (continuous mode);
4. prints a markdown table: validation perplexity on the held-out part's own validation split
   of the pretrained model solved at M steps (before) and of each fine-tune (after).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence

from ode_lm import cli

os.environ.setdefault("JAX_PLATFORMS", "cpu")

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")
PRETRAIN_GIN = os.path.join(CONFIGS, "finetune", "pretrain_demo.gin")
FINETUNE_GIN = os.path.join(CONFIGS, "finetune", "demo.gin")
ROOT = "/tmp/ode_lm/runs/ft_demo"
HOLDOUT_JSONL = "/tmp/ode_lm/data/heldout30.jsonl"


def write_heldout(fraction: float, seed: int) -> int:
    from ode_lm.data.corpus import builtin_documents
    from ode_lm.data.prepare import is_validation

    n = 0
    os.makedirs(os.path.dirname(HOLDOUT_JSONL), exist_ok=True)
    with open(HOLDOUT_JSONL + ".tmp", "w") as f:
        for doc in builtin_documents():
            if is_validation(doc, fraction, seed):
                f.write(json.dumps({"text": doc}) + "\n")
                n += 1
    os.replace(HOLDOUT_JSONL + ".tmp", HOLDOUT_JSONL)
    return n


def zero_shot_perplexity(model, data_config, num_steps: int) -> float:
    """The pretrained model solved at M steps on the fine-tuning validation split."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from ode_lm import data as data_lib

    @nnx.jit
    def sums(m, b):
        logits = m(b["inputs"], b["positions"], b["segment_ids"], num_steps=num_steps)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
        return (ce * b["loss_mask"]).sum(), b["loss_mask"].sum()

    total, count = 0.0, 0.0
    for batch in data_lib.make_eval_iterator(data_config):
        s, n = sums(model, {k: jnp.asarray(v) for k, v in batch.items()})
        total, count = total + float(s), count + float(n)
    del jax
    return math.exp(total / count)


def build_parser(prog: str = "ode-lm finetune-table") -> argparse.ArgumentParser:
    p = cli.doc_parser(prog, __doc__)
    p.add_argument("--pretrain_steps", type=int, default=60)
    p.add_argument("--finetune_steps", type=int, default=15)
    p.add_argument("--depths", type=cli.int_list, default=[3, 6, 12],
                   help="fine-tuning depths M, comma-separated")
    p.add_argument("--methods", default="full,lora", help="full, lora or both")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm finetune-table") -> int:
    args = build_parser(prog).parse_args(argv)
    cli.setup_logging()
    return cli.run_command(prog, lambda: run(args))


def run(args: argparse.Namespace) -> int:

    from ode_lm import gin_setup
    from ode_lm.training.metric_names import PERPLEXITY, name
    from ode_lm.training.run_dir import RunDir
    from ode_lm.training.saved_run import load_model

    t0 = time.time()
    pre_dir = os.path.join(ROOT, "pretrain")
    if not RunDir(pre_dir).has_checkpoint():
        gin_setup.parse_gin(gin_setup.GinFlags(
            files=[PRETRAIN_GIN],
            bindings=[f"TRAIN_STEPS = {args.pretrain_steps}", f"MODEL_DIR = '{pre_dir}'"]))
        res = gin_setup.train()
        print(f"pretrained {res.step} steps: {res.eval}")
        data_cfg = gin_setup.GinDataConfig()
    else:
        gin_setup.parse_gin(gin_setup.GinFlags(files=[PRETRAIN_GIN]))
        data_cfg = gin_setup.GinDataConfig()
    print(f"held-out documents: {write_heldout(data_cfg.holdout_fraction, data_cfg.holdout_seed)}")
    pretrained, _ = load_model(pre_dir)
    rows = []
    for m in args.depths:
        before = None
        for method in args.methods.split(","):
            out = os.path.join(ROOT, f"{method}{m}")
            gin_setup.parse_gin(gin_setup.GinFlags(files=[FINETUNE_GIN], bindings=[
                f"FINETUNE_STEPS = {m}", f"METHOD = '{method}'", f"MODEL_DIR = '{out}'",
                f"PRETRAINED_DIR = '{pre_dir}'", f"TRAIN_STEPS = {args.finetune_steps}"]))
            if before is None:
                ft_data = gin_setup.GinDataConfig()
                from ode_lm import data as data_lib

                data_lib.ensure_prepared(ft_data)
                before = zero_shot_perplexity(pretrained, ft_data, m)
            saved = RunDir(out).finetune_result()
            if saved is not None:
                after, frac = saved["eval"][name(PERPLEXITY)], saved["fraction"]
            else:
                result, info = gin_setup.finetune()
                after, frac = result.eval[name(PERPLEXITY)], info["fraction"]
            rows.append((m, method, 100 * frac, before, after))
    print(f"\n(total {time.time() - t0:.0f}s)\n")
    print("| M (steps) | method | trainable % | ppl before (pretrained @ M) | ppl after |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for m, method, frac, before, after in rows:
        print(f"| {m} | {method} | {frac:.1f} | {before:.2f} | {after:.2f} |")
    return 0
