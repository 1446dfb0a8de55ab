"""Input-pipeline throughput: packed tokens/s from prepared shards and from streaming mode.

  python tools/bench_data.py                       # built-in corpus, bpe:4096, seq 1024, batch 8
  python tools/bench_data.py --data_dir=/data/owt_gpt2 --tokenizer=tiktoken:gpt2 \\
      --stream_source='/data/owt/*.parquet'
  python tools/bench_data.py --threads 1 --grain   # + grain's own pieces against ours

``--grain`` times each hand-written part against the grain piece that could replace it, in
this process, alternating, so a busy machine slows both alike (the WORKSPACE.md "Data"
decisions cite these figures).

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
import zlib
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from ode_lm import cli
from ode_lm.data import DataConfig, ensure_prepared, make_train_iterator, pipeline
from ode_lm.data import packing as packing_lib
from ode_lm.data import sources as sources_lib
from ode_lm.data.corpus import builtin_documents
from ode_lm.data.shuffle import feistel_permute
from ode_lm.data.streaming_source import DocReader, HostFiles


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


def _best(f: Callable[[], Any], reps: int = 5) -> float:
    """Fastest of ``reps`` calls, in seconds (the least disturbed by other processes)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


class _GrainRecords:
    """``grain.sources.ArrayRecordDataSource`` with the interface of ``pipeline.ShardRecords``."""

    def __init__(self, records: pipeline.ShardRecords) -> None:
        counts = np.diff(np.r_[0, records.ends])
        self._src = grain.sources.ArrayRecordDataSource(
            [f"{p}[0:{c}]" for p, c in zip(records.paths, counts, strict=True)])
        self._dtype = records.dtype

    def __len__(self) -> int:
        return len(self._src)

    def __getitems__(self, idx: np.ndarray) -> list[np.ndarray]:
        return [np.frombuffer(r, self._dtype) for r in self._src.__getitems__(idx.tolist())]


class _MemoryBlocks:
    """Documents in memory as a ``packing.DocumentBlocks`` (repeating): packing alone."""

    block_size = 1024

    def __init__(self, docs: list[np.ndarray]) -> None:
        self.docs, self.n = docs, len(docs) // self.block_size

    def read_block(self, b: int) -> list[np.ndarray]:
        b %= self.n
        return self.docs[b * self.block_size:(b + 1) * self.block_size]

    def release(self, low_block: int) -> None: ...

    def get_state(self, min_doc: int) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None: ...

    def epoch(self, doc: int, min_doc: int) -> int:
        return 0

    def close(self) -> None: ...


def _tokens_per_s(it: Any, seconds: float, count: Callable[[Any], int]) -> float:
    next(it)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += count(next(it))
    return n / (time.perf_counter() - start)


def compare_grain(base: DataConfig, stream_source: str, seconds: float) -> None:
    """Ours vs grain's piece, part by part (the figures behind WORKSPACE.md's decisions)."""
    from grain.experimental import index_shuffle

    _, records = pipeline.open_split(base, "train")
    n = len(records)
    j = np.arange(1024)
    ours = _best(lambda: feistel_permute(j, n, 5))
    theirs = _best(lambda: [index_shuffle(int(i), max_index=n - 1, seed=5, rounds=4) for i in j])
    print(f"  permutation, 1024 of {n}: feistel_permute {1024 / ours / 1e6:.2f} M idx/s, "
          f"index_shuffle {1024 / theirs / 1e6:.2f} M idx/s")
    idx = feistel_permute(j, n, 3)
    grain_records = _GrainRecords(records)
    tok = sum(len(d) for d in records.__getitems__(idx))
    ours = _best(lambda: records.__getitems__(idx))
    theirs = _best(lambda: grain_records.__getitems__(idx))
    print(f"  read 1024 shuffled docs: ShardRecords {tok / ours / 1e6:.1f} M tok/s, "
          f"ArrayRecordDataSource {tok / theirs / 1e6:.1f} M tok/s")
    open_split = pipeline.open_split
    for packing in ("concat", "first_fit"):
        rates: dict[str, float] = {}
        for name in ("ShardRecords", "ArrayRecordDataSource") * 2:
            if name == "ShardRecords":
                pipeline.open_split = open_split
            else:
                pipeline.open_split = lambda c, s: (open_split(c, s)[0], grain_records)
            try:
                r = measure(dataclasses.replace(base, packing=packing), seconds / 2)[0]
            finally:
                pipeline.open_split = open_split
            rates[name] = max(rates.get(name, 0.0), r)
        print(f"  prepared {packing}, whole pipeline: " + ", ".join(
            f"{k} {v / 1e6:.2f} M tok/s" for k, v in rates.items()))
    manifest = pipeline.prep.load_manifest(base.data_dir)
    eos, rows, width = manifest["eos_id"], base.global_batch_size, base.seq_len + 1
    docs = records.__getitems__(pipeline.StreamOrder(n, 0, 0, 1, None).lookup(np.arange(2 * n)))
    docs = [d.astype(np.int32) for d in docs]
    for packing in ("concat", "first_fit"):
        it = packing_lib.Packer(_MemoryBlocks(docs), rows=rows, width=width, packing=packing,
                                eos_id=eos, max_carry=rows)
        rate = _tokens_per_s(it, seconds / 2, lambda b: b["inputs"].size)
        print(f"  packing alone (docs in memory), Packer {packing}: {rate / 1e6:.2f} M tok/s")
    pieces = [d[i:i + width] for d in docs for i in range(0, len(d), width)]  # grain bins: <= width
    src = grain.MapDataset.source(pieces).repeat().map(lambda d: {"tokens": d}).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    length = {"tokens": width}
    for name, ds in (
            ("ConcatThenSplit", grain.experimental.ConcatThenSplitIterDataset(
                src, length_struct=length)),
            ("FirstFitPack", grain.experimental.FirstFitPackIterDataset(
                src, length_struct=length, num_packing_bins=rows, shuffle_bins=False))):
        def count(b: dict[str, np.ndarray]) -> int:  # + our batch rule, for the same output
            packing_lib.to_batch(b["tokens"], b["tokens_segment_ids"], b["tokens_positions"], eos)
            return rows * (width - 1)
        rate = _tokens_per_s(iter(ds.batch(rows, drop_remainder=True)), seconds / 2, count)
        print(f"  packing alone, grain {name}: {rate / 1e6:.2f} M tok/s")
    _compare_streaming(dataclasses.replace(base, streaming=True, source=stream_source))


def _compare_streaming(cfg: DataConfig) -> None:
    paths = sources_lib.list_files(cfg.source)
    files = HostFiles(paths, 0, 0, 1, 1)
    order = [files[f] for f in range(files.per_epoch)]

    def ours() -> list[str]:
        reader, out = DocReader(files, cfg, DocReader.initial()), []
        while (doc := reader.next()) is not None:
            out.append(doc[0])
        return out

    def theirs() -> list[str]:
        return list(grain.experimental.InterleaveIterDataset(
            grain.MapDataset.source(order).map(_FileDocs), cycle_length=cfg.interleave_files))

    a, b = ours(), theirs()
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    t_ours, t_theirs = _best(ours, 2), _best(theirs, 2)
    print(f"  interleave {len(order)} files ({cfg.interleave_files} open): DocReader "
          f"{len(a) / t_ours / 1e3:.0f} k docs/s, InterleaveIterDataset "
          f"{len(b) / t_theirs / 1e3:.0f} k docs/s; same documents {sorted(a) == sorted(b)}, "
          f"order first differs at document {first}")
    w = cfg.shuffle_window
    window = a[:w]
    ours_s = _best(lambda: [window[int(i)] for i in feistel_permute(np.arange(w), w, 7)])
    theirs_s = _best(lambda: list(grain.experimental.WindowShuffleIterDataset(
        grain.MapDataset.source(window).to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)), window_size=w, seed=7)))
    print(f"  window shuffle of {w}: feistel_permute {w / ours_s / 1e6:.2f} M docs/s, "
          f"WindowShuffleIterDataset {w / theirs_s / 1e6:.3f} M docs/s")


class _FileDocsIterator(grain.DatasetIterator):
    """The documents of one file, for ``InterleaveIterDataset`` (state: documents read)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path, self._n, self._it = path, 0, None

    def __next__(self) -> str:
        if self._it is None:
            self._it = sources_lib.iter_source_file(self._path, sources_lib.SkippedFiles(),
                                                    skip=self._n)
        doc = next(self._it)
        self._n += 1
        return doc[0]

    def get_state(self) -> dict[str, int]:
        return {"read": self._n}

    def set_state(self, state: dict[str, int]) -> None:
        self._n, self._it = state["read"], None


class _FileDocs(grain.IterDataset):
    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def __iter__(self) -> _FileDocsIterator:
        return _FileDocsIterator(self._path)


def mixture_config(base: DataConfig) -> DataConfig:
    """The built-in corpus split in two prepared halves with ``base``'s tokenizer (trained
    once, on the whole corpus: the base data dir's tokenizer file), weighted 70/30."""
    tok = (f"hf:{os.path.join(base.data_dir, 'tokenizer.json')}"
           if base.tokenizer.startswith("bpe:") else base.tokenizer)
    root = os.path.join(tempfile.gettempdir(), "ode_lm_cache", "bench_mixture")
    parts = {name: {"source": f"builtin:part={i}/2", "tokenizer": tok,
                    "data_dir": os.path.join(root, f"{name}-{zlib.crc32(tok.encode()):08x}")}
             for i, name in enumerate(("even", "odd"))}
    return dataclasses.replace(base, packing="concat", tokenizer=tok, data_dir=None,
                               mixture=parts,
                               mixture_weights=((0, {"even": 0.7, "odd": 0.3}),))


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
    ap.add_argument("--grain", action="store_true", help="also time grain's pieces against ours")
    ap.add_argument("--row_shuffle_window", type=int,
                    default=DataConfig.row_shuffle_window, help="rows shuffled together after "
                    "packing (DataConfig.row_shuffle_window; 0: packing order)")
    args = ap.parse_args(argv)
    base = DataConfig(tokenizer=args.tokenizer, seq_len=args.seq_len,
                      global_batch_size=args.batch, num_threads=args.threads, prefetch=2,
                      num_workers=args.workers, row_shuffle_window=args.row_shuffle_window)
    if args.data_dir:
        base = dataclasses.replace(base, data_dir=args.data_dir)
    m = ensure_prepared(base)
    tr = m["splits"]["train"]
    print(f"prepared: {base.data_dir} ({tr['documents']} docs, {tr['tokens']} tokens, "
          f"{tr['tokens'] / tr['documents']:.0f} tokens/doc), seq_len {args.seq_len}, "
          f"batch {args.batch}, row shuffle window {args.row_shuffle_window}, "
          f"load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for packing in ("concat", "first_fit"):
        rate, per_cpu, n = measure(dataclasses.replace(base, packing=packing), args.seconds)
        print(f"  prepared  {packing:9s}: {rate / 1e6:6.2f} M tokens/s "
              f"({per_cpu / 1e6:.2f} M per CPU-second, {n} batches)")
    mix = mixture_config(base)  # the built-in corpus in two halves, weighted 70/30
    ensure_prepared(mix)
    rate, per_cpu, n = measure(mix, args.seconds)
    print(f"  mixture   concat   : {rate / 1e6:6.2f} M tokens/s ({per_cpu / 1e6:.2f} M per "
          f"CPU-second, {n} batches, 2 components of the built-in corpus, 70/30)")
    src = args.stream_source or builtin_jsonl(8)
    if args.grain:
        print("grain's pieces against ours (same process, alternating):")
        compare_grain(base, src, args.seconds)
    if args.skip_streaming:
        return
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
