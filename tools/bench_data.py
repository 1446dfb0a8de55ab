"""Input-pipeline throughput: packed tokens/s from prepared shards and from streaming mode.

  python tools/bench_data.py                       # built-in corpus, bpe:4096, seq 1024, batch 8
  python tools/bench_data.py --data_dir=/data/owt_gpt2 --tokenizer=tiktoken:gpt2 \\
      --stream_source='/data/owt/*.parquet'

Counts every token of every batch row (inputs), after a warm-up batch. Also prints tokens
per CPU-second of this process (worker processes excluded) and the load average: on a shared
machine the wall-clock figure mostly measures the other processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from ode_lm import cli
from ode_lm.data import DataConfig, ensure_prepared, make_train_iterator
from ode_lm.data.corpus import builtin_documents


def measure(cfg: DataConfig, seconds: float, min_batches: int = 5) -> tuple[float, float, int]:
    """(wall-clock tokens/s, tokens per CPU-second of this process, batches)."""
    it = make_train_iterator(cfg, process_index=0, process_count=1)
    next(it)  # warm-up: opens shards / files, fills the first block
    n_tok = n = 0
    start, cpu = time.perf_counter(), time.process_time()
    while n < min_batches or time.perf_counter() - start < seconds:
        n_tok += next(it)["inputs"].size
        n += 1
    rate = n_tok / (time.perf_counter() - start)
    per_cpu = n_tok / max(time.process_time() - cpu, 1e-9)
    if hasattr(it, "close"):
        it.close()
    return rate, per_cpu, n


def builtin_jsonl(n_files: int) -> str:
    """The built-in corpus as ``n_files`` jsonl files, for the streaming benchmark."""
    d = os.path.join(tempfile.gettempdir(), "ode_lm_cache", f"builtin_jsonl_{n_files}")
    os.makedirs(d, exist_ok=True)
    docs = builtin_documents()
    for i in range(n_files):
        path = os.path.join(d, f"part-{i:03d}.jsonl")
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in docs[i::n_files])
            os.replace(path + ".tmp", path)
    return d


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data_dir", default=None, help="prepared dir (default: built-in corpus)")
    ap.add_argument("--tokenizer", default="bpe:4096")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="host batch (rows)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=0, help="streaming tokenizer processes")
    ap.add_argument("--stream_source", default=None, help="files (default: built-in as jsonl)")
    ap.add_argument("--stream_tokenizer", default=None, help="default: --tokenizer")
    ap.add_argument("--skip_streaming", action="store_true")
    args = ap.parse_args(argv)
    base = DataConfig(tokenizer=args.tokenizer, seq_len=args.seq_len,
                      global_batch_size=args.batch, num_threads=args.threads, prefetch=2,
                      num_workers=args.workers)
    if args.data_dir:
        base = dataclasses.replace(base, data_dir=args.data_dir)
    m = ensure_prepared(base)
    tr = m["splits"]["train"]
    print(f"prepared: {base.data_dir} ({tr['documents']} docs, {tr['tokens']} tokens, "
          f"{tr['tokens'] / tr['documents']:.0f} tokens/doc), seq_len {args.seq_len}, "
          f"batch {args.batch}, load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for packing in ("concat", "first_fit"):
        rate, per_cpu, n = measure(dataclasses.replace(base, packing=packing), args.seconds)
        print(f"  prepared  {packing:9s}: {rate / 1e6:6.2f} M tokens/s "
              f"({per_cpu / 1e6:.2f} M per CPU-second, {n} batches)")
    if args.skip_streaming:
        return
    src = args.stream_source or builtin_jsonl(8)
    stream = dataclasses.replace(base, streaming=True, source=src,
                                 tokenizer=args.stream_tokenizer or args.tokenizer)
    for packing in ("concat",):
        rate, per_cpu, n = measure(dataclasses.replace(stream, packing=packing), args.seconds)
        print(f"  streaming {packing:9s}: {rate / 1e6:6.2f} M tokens/s "
              f"({per_cpu / 1e6:.2f} M per CPU-second, {n} batches, "
              f"tokenizer {stream.tokenizer}, {args.workers} worker processes, "
              f"{args.threads} threads)")
    print(f"load avg after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
