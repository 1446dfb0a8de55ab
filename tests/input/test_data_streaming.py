"""Streaming mode: files -> interleave -> tokenize -> window shuffle -> pack; checkpointable."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from data_helpers import (
    assert_batches_equal,
    builtin_config,
    run_resume_script,
    small_texts,
    take,
    write_jsonl,
)

from ode_lm.data import DataConfig, make_train_iterator
from ode_lm.data import packing as packing_lib
from ode_lm.data.streaming_source import HostFiles


def jsonl_dir(tmp_path, n_files=6, n_docs=300):
    texts = small_texts(n_docs)
    d = tmp_path / "raw"
    d.mkdir()
    for i in range(n_files):
        write_jsonl(d / f"part-{i:02d}.jsonl", texts[i::n_files])
    return d, texts


def parquet_dir(tmp_path, n_files=4, n_docs=240):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = small_texts(n_docs)
    d = tmp_path / "pq"
    d.mkdir()
    for i in range(n_files):
        pq.write_table(pa.table({"text": texts[i::n_files]}), d / f"train-{i:05d}.parquet",
                       row_group_size=9)
    return d, texts


def stream_config(src, **kw) -> DataConfig:
    kw = {"tokenizer": "bytes", "streaming": True, "seq_len": 64, "global_batch_size": 4,
          "shuffle_window": 40, "interleave_files": 3, "prefetch": 0, **kw}
    return DataConfig(data_dir=str(src) + "_dd", source=str(src), **kw)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_streaming_batches_and_determinism(tmp_path, packing):
    src, _ = jsonl_dir(tmp_path)
    cfg = stream_config(src, packing=packing)
    a = take(make_train_iterator(cfg, process_index=0, process_count=1), 6)
    assert a[0]["inputs"].shape == (4, 64) and a[0]["loss_mask"].dtype == np.float32
    b = take(make_train_iterator(dataclasses.replace(cfg, num_workers=2, num_threads=1,
                                                     prefetch=2),
                                 process_index=0, process_count=1), 6)
    assert_batches_equal(a, b)  # workers/threads/prefetch never change the batches
    c = take(make_train_iterator(dataclasses.replace(cfg, seed=3), process_index=0,
                                 process_count=1), 6)
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])


def test_streaming_epoch_covers_every_document_once(tmp_path, monkeypatch):
    src, texts = jsonl_dir(tmp_path)
    cfg = stream_config(src, packing="first_fit", num_epochs=1, seq_len=512)
    rows = []
    to_batch = packing_lib.to_batch
    monkeypatch.setattr(packing_lib, "to_batch",
                        lambda tok, seg, pos, eos: rows.append((tok, seg)) or to_batch(
                            tok, seg, pos, eos))
    list(make_train_iterator(cfg, process_index=0, process_count=1))
    pieces = [bytes(tok[r][seg[r] == s][:-1].astype(np.uint8)).decode()
              for tok, seg in rows for r in range(len(tok)) for s in range(1, seg[r].max() + 1)]
    assert sorted(pieces) == sorted(texts)


def streamed_docs(cfg) -> list[str]:
    """The document order of a concat stream (bytes tokenizer: split the rows at EOS)."""
    b = next(make_train_iterator(cfg, process_index=0, process_count=1))
    flat = np.c_[b["inputs"], b["targets"][:, -1:]].ravel()
    cuts = np.nonzero(flat == 256)[0]
    return [bytes(flat[i + 1:j].astype(np.uint8)).decode()
            for i, j in zip(cuts, cuts[1:], strict=False)]


def test_window_shuffle_and_interleave_order(tmp_path):
    src, texts = jsonl_dir(tmp_path, n_files=2, n_docs=40)
    cfg = stream_config(src, shuffle_window=1, interleave_files=2, global_batch_size=8,
                        seq_len=512, row_shuffle_window=0)  # the rows in packing order
    files = HostFiles([str(src / "part-00.jsonl"), str(src / "part-01.jsonl")], 0, 0, 1, 1)
    a, b = texts[int(files[0][-7])::2], texts[int(files[1][-7])::2]
    docs = streamed_docs(cfg)
    assert docs[:6] == [b[0], a[1], b[1], a[2], b[2], a[3]]  # round-robin, in file order
    shuffled = streamed_docs(dataclasses.replace(cfg, shuffle_window=40))
    assert shuffled[:6] != docs[:6] and set(shuffled[:6]) <= set(texts)


def test_hosts_read_disjoint_files(tmp_path):
    files = [f"f{i}.jsonl" for i in range(10)]
    per_host = [[HostFiles(files, 0, p, 4, 1)[f] for f in range(HostFiles(files, 0, p, 4, 1)
                                                               .per_epoch)] for p in range(4)]
    flat = [f for h in per_host for f in h]
    assert sorted(flat) == sorted(files)
    epoch2 = [HostFiles(files, 0, 0, 1, None)[f] for f in range(10, 20)]
    assert sorted(epoch2) == sorted(files) and epoch2 != [HostFiles(files, 0, 0, 1, None)[f]
                                                          for f in range(10)]
    with pytest.raises(ValueError, match="3 source files for 4 processes"):
        HostFiles(files[:3], 0, 0, 4, None)


@pytest.mark.parametrize("packing, kind", [("concat", "jsonl"), ("first_fit", "parquet")])
def test_streaming_exact_resume_in_a_fresh_process(tmp_path, packing, kind):
    src, _ = jsonl_dir(tmp_path) if kind == "jsonl" else parquet_dir(tmp_path)
    cfg = stream_config(src, packing=packing, prefetch=2)
    k = 5
    reference = take(make_train_iterator(cfg, process_index=0, process_count=1), 2 * k)
    first = run_resume_script(cfg, "save", tmp_path / "ckpt", tmp_path / "a.npz", k)
    second = run_resume_script(cfg, "restore", tmp_path / "ckpt", tmp_path / "b.npz", k)
    assert_batches_equal(first + second, reference)


def test_streaming_start_step_fallback_and_bad_sources(tmp_path):
    src, _ = jsonl_dir(tmp_path)
    cfg = stream_config(src)
    it = make_train_iterator(cfg, process_index=0, process_count=1, start_step=60)
    state = it.get_state()
    assert state["reader"]["next_file"] > 0, "fallback starts past the first file, not at 0"
    assert set(state) == {"doc", "offset", "carry", "window", "reader", "row"}, \
        "the checkpointed keys"
    assert set(state["reader"]) == {"next_file", "turn", "slots"}
    again = make_train_iterator(cfg, process_index=0, process_count=1, start_step=60)
    assert_batches_equal(take(it, 2), take(again, 2))
    with pytest.raises(ValueError, match="not a file source"):
        make_train_iterator(builtin_config(streaming=True), process_index=0, process_count=1)


def test_first_fit_carry_from_an_older_window_resumes(tmp_path):
    """A first-fit piece carried while the packer moves into a later shuffle window keeps
    its window's reader position in the state (a small window makes this happen at once)."""
    src, _ = jsonl_dir(tmp_path)
    cfg = stream_config(src, packing="first_fit", shuffle_window=7, interleave_files=2,
                        row_shuffle_window=0)  # the packer's own states, one per batch
    it = make_train_iterator(cfg, process_index=0, process_count=1)
    states, batches = [], []
    for _ in range(12):
        states.append(it.get_state())
        batches.append(next(it))
    assert any(c[0] // 7 < s["doc"] // 7 for s in states for c in s["carry"]), \
        "the case under test: a carried piece from an older window"
    for k in (3, 6, 9):
        fresh = make_train_iterator(cfg, process_index=0, process_count=1)
        fresh.set_state(states[k])
        assert_batches_equal(take(fresh, 3), batches[k:k + 3])
