"""Raw text -> tokenized ArrayRecord shards + manifest.json (idempotent, resumable).

  ode-lm prepare --source=builtin --tokenizer=bpe:4096 --data_dir=/tmp/owt
  ode-lm prepare --source='gs://bucket/owt/*.parquet' --tokenizer=tiktoken:gpt2 \\
      --data_dir=gs://bucket/owt_gpt2 --num_proc=32
  ode-lm prepare --source=hf://datasets/Skylion007/openwebtext \\
      --tokenizer=tiktoken:gpt2 --data_dir=gs://bucket/owt_gpt2 --num_proc=32

Re-running skips finished chunks; an interrupted run resumes without duplicates.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ode_lm import cli
from ode_lm.data.config import DataConfig
from ode_lm.errors import UsageError

# What the demo's eval reads (configs/runs/demo.gin: DataConfig.eval_max_batches; its model,
# configs/models/tiny.gin: BATCH_SIZE, SEQ_LEN; tests/input/test_data_prepare.py checks these
# against the files): a prepared split with fewer tokens trains or evaluates short, or not at all.
DEMO_EVAL_BATCHES, DEMO_BATCH_SIZE, DEMO_SEQ_LEN = 20, 8, 128
_MAX_SUGGESTED_HOLDOUT = 0.5


def build_parser(prog: str = "ode-lm prepare") -> argparse.ArgumentParser:
    d = DataConfig()
    ap = cli.doc_parser(prog, __doc__)
    ap.add_argument("--source", default=d.source,
                    help="builtin | paths/globs/dirs (local, gs://) | "
                         "hf://datasets/<owner>/<name>[/<glob>] | tfds:<name>")
    ap.add_argument("--data_dir", default=None,
                    help="output dir (default: a cache dir keyed by source/tokenizer/holdout)")
    ap.add_argument("--tokenizer", default=d.tokenizer)
    ap.add_argument("--text_field", default=d.text_field)
    ap.add_argument("--text_delimiter", default=None,
                    help="split .txt files into documents on this string (default: 1 per file)")
    ap.add_argument("--non_utf8", choices=("replace", "skip"), default=d.non_utf8)
    ap.add_argument("--holdout_fraction", type=float, default=d.holdout_fraction)
    ap.add_argument("--holdout_seed", type=int, default=d.holdout_seed)
    ap.add_argument("--docs_per_shard", type=int, default=d.docs_per_shard)
    ap.add_argument("--num_proc", type=int, default=None, help="tokenizer processes (default: all)")
    ap.add_argument("--no_progress", action="store_true")
    return ap


class HeldWarnings(logging.Handler):
    """The run's warnings (a skipped source file, an odd tokenizer), held until it ends:
    printed after a run that succeeds, dropped after one that fails, whose one error line
    says what stopped it."""

    def __init__(self, prog: str):
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter(f"{prog}: warning: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm prepare") -> int:
    args = build_parser(prog).parse_args(argv)
    held = HeldWarnings(prog)
    log = logging.getLogger("ode_lm")  # not on to the root: a library's handler there
    propagate, log.propagate = log.propagate, False  # would print them at once
    log.addHandler(held)
    try:
        code = cli.run_command(prog, lambda: run(args))
    finally:
        log.removeHandler(held)
        log.propagate = propagate
    if code == 0:
        for line in held.lines:
            print(line, file=sys.stderr)
    return code


def split_warnings(manifest: dict[str, Any]) -> list[str]:
    """One line per split too small for the demo's model (``configs/runs/demo.gin``): an empty
    or tiny validation split names the --holdout_fraction that gives the eval it reads."""
    row = DEMO_BATCH_SIZE * (DEMO_SEQ_LEN + 1)  # tokens of one batch (inputs and targets)
    need = DEMO_EVAL_BATCHES * row
    splits = manifest["splits"]
    train, val = splits["train"]["tokens"], splits["validation"]["tokens"]
    total, fraction = train + val, manifest["holdout"]["fraction"]
    out = []
    if train < row:
        lower = f" or a lower --holdout_fraction (now {fraction})" if fraction > 0 else ""
        out.append(f"split 'train' has {train} tokens, fewer than one batch of the demo's model "
                   f"({DEMO_BATCH_SIZE} x {DEMO_SEQ_LEN + 1} = {row}): use more documents{lower}")
    if val < need:
        what = "is empty" if val == 0 else f"has {val} tokens"
        head = (f"split 'validation' {what} (--holdout_fraction={fraction}), fewer than the "
                f"demo's eval reads ({DEMO_EVAL_BATCHES} batches of {DEMO_BATCH_SIZE} x "
                f"{DEMO_SEQ_LEN + 1} = {need} tokens)")
        suggested = math.ceil(100 * 1.25 * need / max(total, 1)) / 100  # 25%: the rule is random
        if suggested <= fraction:  # given already (long documents fall whole to one side):
            suggested = (math.ceil(100 * 1.25 * fraction * need / val) / 100 if val  # scale it
                         else _MAX_SUGGESTED_HOLDOUT + 1)
        if fraction < suggested <= _MAX_SUGGESTED_HOLDOUT:
            out.append(f"{head}: prepare into a new --data_dir with "
                       f"--holdout_fraction={suggested:g}")
        else:
            out.append(f"{head}: the corpus ({total} tokens) is too small for it; evaluate "
                       "fewer batches (--gin.DataConfig.eval_max_batches=N) or add documents")
    return out


def run(args: argparse.Namespace) -> int:
    from ode_lm.data.manifest import MANIFEST, manifest_path
    from ode_lm.data.prepare import prepare

    if args.num_proc is not None and args.num_proc < 1:
        raise UsageError(f"--num_proc={args.num_proc}: must be >= 1")
    if args.tokenizer.startswith("bpe:"):  # the size on its own: a flag value, exit 2
        from ode_lm.data.tokenizers import bpe_vocab_size

        try:
            bpe_vocab_size(args.tokenizer)
        except ValueError as e:
            raise UsageError(f"--tokenizer={args.tokenizer}: {e}") from None
    if args.data_dir and os.path.isfile(args.data_dir):
        raise NotADirectoryError(f"--data_dir={args.data_dir}: is a file, not a directory")
    delimiter = args.text_delimiter.encode().decode("unicode_escape") if args.text_delimiter \
        else None
    cfg = DataConfig(data_dir=args.data_dir, source=args.source, tokenizer=args.tokenizer,
                     text_field=args.text_field, text_delimiter=delimiter,
                     non_utf8=args.non_utf8, holdout_fraction=args.holdout_fraction,
                     holdout_seed=args.holdout_seed, docs_per_shard=args.docs_per_shard)
    # the bar only on a terminal: in a log its redraws are fragments before any error line
    m = prepare(cfg, num_proc=args.num_proc,
                progress=not args.no_progress and sys.stderr.isatty())
    for split, info in m["splits"].items():
        print(f"{split}: {info['documents']} documents, {info['tokens']} tokens, "
              f"{len(info['shards'])} shards")
    skipped = m.get("skipped_files") or {}
    if skipped.get("empty") or skipped.get("unreadable"):
        print(f"skipped source files: {skipped['empty']} empty, {skipped['unreadable']} unreadable "
              f"(listed in {MANIFEST} skipped_files)")
    print(f"manifest: {manifest_path(cfg.data_dir)} (vocab {m['vocab_size']}, "
          f"eos {m['eos_id']})")
    for line in split_warnings(m):  # held with the run's other warnings, printed at its end
        logging.getLogger("ode_lm.data.prepare").warning(line)
    return 0
