"""The README's adaptive-depth table: pretrain cpu_small at 6 steps, fine-tune at M steps.

  ode-lm finetune-table [--pretrain_steps=60] [--finetune_steps=15] [--depths=3,6,12]
                        [--methods=full,lora] [--work_dir=/tmp/ode_lm/runs/ft_demo]

1. pretrains ``configs/finetune/pretrain_demo.gin`` (built-in corpus, 30% of documents held
   out) unless that pretraining is done;
2. writes the held-out documents to a jsonl (the data module's own hold-out rule);
3. fine-tunes ``configs/finetune/demo.gin`` at each M, full and LoRA (continuous mode);
4. prints a markdown table: validation perplexity on the held-out part's own validation split
   of the pretrained model solved at M steps (before) and of each fine-tune (after).

Every run lives under --work_dir in a directory named by the settings that change its result
(``pretrain<P>-<hash>/finetune<F>-<hash>/<method><M>``, the hash over the steps and the gin
files' text): a rerun with the same settings reuses the finished runs, other settings run anew.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence

from ode_lm import cli
from ode_lm.claims.runs import CONFIGS, gin_text
from ode_lm.errors import UsageError

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PRETRAIN_GIN = os.path.join(CONFIGS, "finetune", "pretrain_demo.gin")
FINETUNE_GIN = os.path.join(CONFIGS, "finetune", "demo.gin")
ROOT = "/tmp/ode_lm/runs/ft_demo"
METHODS = ("full", "lora")


def settings_key(prefix: str, steps: int, *gin_files: str) -> str:
    """``<prefix><steps>-<8 hex>``: readable steps, and a hash of everything that sets the
    result (the steps and the gin files' text)."""
    digest = hashlib.sha256(json.dumps([steps, *map(gin_text, gin_files)]).encode())
    return f"{prefix}{steps}-{digest.hexdigest()[:8]}"


def work_dirs(work_dir: str, pretrain_steps: int, finetune_steps: int) -> tuple[str, str]:
    """(the pretraining's dir, the dir of its fine-tunes) for these settings."""
    pre = os.path.join(work_dir, settings_key("pretrain", pretrain_steps, PRETRAIN_GIN))
    return pre, os.path.join(pre, settings_key("finetune", finetune_steps, FINETUNE_GIN))


def write_heldout(path: str, fraction: float, seed: int) -> int:
    """The documents the pretraining held out, one jsonl record each (written atomically)."""
    from ode_lm.data.corpus import builtin_documents
    from ode_lm.data.prepare import is_validation

    n = 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for doc in builtin_documents():
            if is_validation(doc, fraction, seed):
                f.write(json.dumps({"text": doc}) + "\n")
                n += 1
    os.replace(path + ".tmp", path)
    return n


def zero_shot_perplexity(model, data_config, num_steps: int) -> float:
    """The pretrained model solved at M steps on the fine-tuning validation split."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from ode_lm import data as data_lib
    from ode_lm.models.solve import Solve

    @nnx.jit
    def sums(m, b):
        logits = m(b["inputs"], b["positions"], b["segment_ids"], solve=Solve(None, num_steps))
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
    p.add_argument("--work_dir", default=ROOT,
                   help="where the runs live, each in a directory named by its settings")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before any pretraining starts (exit 2, naming the flag)."""
    for flag in ("pretrain_steps", "finetune_steps"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag}={getattr(args, flag)}: must be >= 1")
    if any(m < 1 for m in args.depths):
        raise UsageError(f"--depths={','.join(map(str, args.depths))}: every depth M must be "
                         ">= 1")
    methods = args.methods.split(",")
    if not methods or any(m not in METHODS for m in methods):
        raise UsageError(f"--methods={args.methods}: expected full, lora or full,lora")
    if os.path.exists(args.work_dir) and not os.path.isdir(args.work_dir):
        raise NotADirectoryError(f"--work_dir={args.work_dir}: not a directory")


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm finetune-table") -> int:
    args = build_parser(prog).parse_args(argv)
    cli.setup_logging()
    return cli.run_command(prog, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    check_args(args)
    from ode_lm import gin_setup
    from ode_lm.training.metric_names import PERPLEXITY, name
    from ode_lm.training.run_dir import RunDir
    from ode_lm.training.saved_run import load_model

    t0 = time.time()
    pre_root, ft_root = work_dirs(args.work_dir, args.pretrain_steps, args.finetune_steps)
    pre_dir, corpus_dir = os.path.join(pre_root, "run"), os.path.join(pre_root, "corpus")
    pre_flags = gin_setup.GinFlags(files=[PRETRAIN_GIN], bindings=[
        f"TRAIN_STEPS = {args.pretrain_steps}", f"MODEL_DIR = {pre_dir!r}",
        f"DATA_DIR = {corpus_dir!r}"])
    gin_setup.parse_gin(pre_flags)
    data_cfg = gin_setup.GinDataConfig()
    if args.pretrain_steps in RunDir(pre_dir).checkpoint_steps():
        print(f"pretrained run: {pre_dir} (reused: same settings)")
    else:
        res = gin_setup.train()
        print(f"pretrained {res.step} steps -> {pre_dir}: {res.eval}")
    heldout = os.path.join(pre_root, "heldout.jsonl")
    count = write_heldout(heldout, data_cfg.holdout_fraction, data_cfg.holdout_seed)
    print(f"held-out documents: {count}")
    pretrained, _ = load_model(pre_dir)
    tokenizer = "hf:" + os.path.join(corpus_dir, "tokenizer.json")  # the pretraining's BPE
    data_bindings = [f"DataConfig.source = {heldout!r}", f"DataConfig.tokenizer = {tokenizer!r}",
                     f"DataConfig.data_dir = {os.path.join(pre_root, 'heldout-data')!r}"]
    rows = []
    for m in args.depths:
        before = None
        for method in args.methods.split(","):
            out = os.path.join(ft_root, f"{method}{m}")
            gin_setup.parse_gin(gin_setup.GinFlags(files=[FINETUNE_GIN], bindings=[
                f"FINETUNE_STEPS = {m}", f"METHOD = '{method}'", f"MODEL_DIR = {out!r}",
                f"PRETRAINED_DIR = {pre_dir!r}", f"TRAIN_STEPS = {args.finetune_steps}",
                *data_bindings]))
            if before is None:
                ft_data = gin_setup.GinDataConfig()
                from ode_lm import data as data_lib

                data_lib.ensure_prepared(ft_data)
                before = zero_shot_perplexity(pretrained, ft_data, m)
            saved = RunDir(out).finetune_result()
            if saved is not None:
                print(f"{method} at M={m}: {out} (reused: same settings)")
                after, frac = saved["eval"][name(PERPLEXITY)], saved["fraction"]
            else:
                result, info = gin_setup.finetune()
                after, frac = result.eval[name(PERPLEXITY)], info["fraction"]
            rows.append((m, method, 100 * frac, before, after))
    print(f"\n(total {time.time() - t0:.0f}s; runs under {ft_root})\n")
    print("| M (steps) | method | trainable % | ppl before (pretrained @ M) | ppl after |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for m, method, frac, before, after in rows:
        print(f"| {m} | {method} | {frac:.1f} | {before:.2f} | {after:.2f} |")
    return 0
