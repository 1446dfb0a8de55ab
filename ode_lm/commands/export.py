"""Export an ode-lm run (any mesh's checkpoint, on one CPU, parameters only).

  ode-lm export --model_dir=RUN --format=hf --out=DIR [--num_steps=M]
      [--step=S] [--dtype=fp32|bf16] [--verify] [--data_dir=PREPARED | --weights_only]
      [--max_shard_mb=N] [--overwrite]

Formats: raw (hypernetwork parameters as safetensors + JSON config, lossless), hf (the model
materialised at M Euler steps; neox → GPTNeoXForCausalLM, gpt2/llama → shipped modelling
files, trust_remote_code=True), hf-neox (native GPTNeoX only).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

from ode_lm import cli


def build_parser(prog: str = "ode-lm export") -> argparse.ArgumentParser:
    from ode_lm.export.convert import FORMATS

    p = cli.doc_parser(prog, __doc__)
    p.add_argument("--model_dir", required=True, help="training or fine-tuning run directory")
    p.add_argument("--format", required=True, help=f"one of {', '.join(FORMATS)}")
    p.add_argument("--out", required=True,
                   help="export directory (created; must be empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out: the new export is written beside it and "
                        "swapped in when complete and checked (the old one stays if the export or "
                        "--verify fails)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--num_steps", type=int, default=None,
                   help="hf: materialise the ODE at M Euler steps (default: the run's)")
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16")
    p.add_argument("--verify", action="store_true",
                   help="load the export back and compare logits with ode-lm, before it is "
                        "moved to --out")
    p.add_argument("--data_dir", default=None,
                   help="prepared data dir whose tokenizer to copy (default: the run's)")
    p.add_argument("--weights_only", action="store_true",
                   help="export without the run's tokenizer (its data dir may be gone)")
    p.add_argument("--max_shard_mb", type=float, default=2048.0,
                   help="safetensors shard size above which the export is sharded")
    return p


def run(args: argparse.Namespace) -> int:
    from ode_lm.export.convert import export

    t0 = time.time()
    result = export(
        args.model_dir, args.format, args.out, step=args.step, num_steps=args.num_steps,
        dtype=args.dtype, verify_logits=args.verify, data_dir=args.data_dir,
        max_shard_bytes=int(args.max_shard_mb * 1024 * 1024), weights_only=args.weights_only,
        overwrite=args.overwrite,
    )
    print(f"exported step {result.step} of {args.model_dir} as {result.format} to {result.out_dir}"
          f" ({len(result.files)} files, {time.time() - t0:.1f}s)")
    if result.max_abs_diff is not None:
        print(f"verify: max |Δ logits| = {result.max_abs_diff:.3g} ({args.dtype})")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "ode-lm export") -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # one CPU is enough, before jax loads
    args = build_parser(prog).parse_args(argv)
    cli.setup_logging()
    # AssertionError: --verify's logit comparison failing is the run's failure, not a bug
    return cli.run_command(prog, lambda: run(args), errors=(AssertionError,))
