"""Offline preparation: shards + manifest, holdout rule, idempotent resume, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import small_texts, tree_hash, write_jsonl

from ode_lm.data import (
    DataConfig,
    PreparedDataError,
    check_tokenizer,
    load_manifest,
    make_train_iterator,
    prepare,
)
from ode_lm.data.pipeline import open_split
from ode_lm.data.prepare import is_validation, token_dtype
from ode_lm.data.tokenizers import train_bpe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def jsonl_config(tmp_path, texts=None, **kw) -> DataConfig:
    src = write_jsonl(tmp_path / "raw.jsonl", texts or small_texts(60))
    kw = {"tokenizer": "bytes", "holdout_fraction": 0.2, "docs_per_shard": 16, "prefetch": 0,
          "seq_len": 16, "global_batch_size": 2, **kw}
    return DataConfig(data_dir=str(tmp_path / "prepared"), source=str(src), **kw)


def read_split(cfg, split):
    _, records = open_split(cfg, split)
    return [records[i] for i in range(len(records))]


def test_manifest_shards_and_holdout_rule(tmp_path):
    texts = small_texts(60)
    cfg = jsonl_config(tmp_path, texts)
    m = prepare(cfg, num_proc=1, progress=False, log=lambda *_: None)
    val = [t for t in texts if is_validation(t, 0.2, 2357)]
    train = [t for t in texts if not is_validation(t, 0.2, 2357)]
    assert 0 < len(val) < len(train)
    for split, expected in (("train", train), ("validation", val)):
        docs = read_split(cfg, split)
        assert [bytes(d[:-1].astype(np.uint8)).decode() for d in docs] == expected
        assert all(d[-1] == 256 for d in docs), "EOS appended"
        info = m["splits"][split]
        assert info["documents"] == len(expected)
        assert info["tokens"] == sum(len(t.encode()) + 1 for t in expected)
    assert len(m["splits"]["train"]["shards"]) == 4  # 60 docs / 16 per chunk
    assert m["tokenizer"]["spec"] == "bytes" and m["dtype"] == "<u2"
    assert m["source"]["spec"] == cfg.source and m["holdout"]["seed"] == 2357
    assert token_dtype(50257) == np.dtype("<u2") and token_dtype(100_000) == np.dtype("<u4")


def test_holdout_rule_is_independent_of_workers(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = jsonl_config(tmp_path / "a"), jsonl_config(tmp_path / "b")
    ma = prepare(a, num_proc=1, progress=False, log=lambda *_: None)
    mb = prepare(b, num_proc=2, progress=False, log=lambda *_: None)
    assert ma["splits"] == mb["splits"]
    for s in ma["splits"]["train"]["shards"] + ma["splits"]["validation"]["shards"]:
        assert (tmp_path / "a" / "prepared" / s["path"]).read_bytes() == \
            (tmp_path / "b" / "prepared" / s["path"]).read_bytes()


def test_idempotent_and_resumes_after_interruption(tmp_path):
    cfg = jsonl_config(tmp_path)
    quiet = {"num_proc": 1, "progress": False, "log": lambda *_: None}
    m = prepare(cfg, **quiet)
    root = tmp_path / "prepared"
    originals = {p.name: p.read_bytes() for p in root.glob("*.array_record")}
    mtimes = {p.name: p.stat().st_mtime_ns for p in root.glob("*.array_record")}
    assert prepare(cfg, **quiet) == m
    (root / "manifest.json").unlink()
    assert prepare(cfg, **quiet)["splits"] == m["splits"]
    assert {p.name: p.stat().st_mtime_ns for p in root.glob("*.array_record")} == mtimes
    # an interrupted run: chunk 1's marker never written, its shard half-written, a stray tmp
    (root / "manifest.json").unlink()
    (root / "chunks" / "00001.json").unlink()
    shard = root / "train-00001.array_record"
    shard.write_bytes(shard.read_bytes()[:50])
    (root / "train-00002.array_record.tmp999").write_bytes(b"partial")
    assert prepare(cfg, **quiet)["splits"] == m["splits"]
    assert {p.name: p.read_bytes() for p in root.glob("*.array_record")} == originals
    assert {p.name for p in root.glob("*.array_record")} == set(originals)
    with pytest.raises(PreparedDataError, match="prepared with holdout_fraction=0.2, not 0.3"):
        prepare(jsonl_config(tmp_path, holdout_fraction=0.3), **quiet)


@pytest.mark.parametrize("policy", ["replace", "skip"])
def test_non_utf8_counted_in_manifest(tmp_path, policy):
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(b'{"text": "good one"}\n{"text": "bad \xff byte"}\n{"text": "good two"}\n')
    cfg = DataConfig(data_dir=str(tmp_path / "p"), source=str(raw), tokenizer="bytes",
                     holdout_fraction=0.0, non_utf8=policy)
    m = prepare(cfg, num_proc=1, progress=False, log=lambda *_: None)
    assert m["non_utf8"] == {"policy": policy, "documents": 1,
                             "skipped": 1 if policy == "skip" else 0}
    assert m["splits"]["train"]["documents"] == (2 if policy == "skip" else 3)


def test_tokenizer_mismatch_and_truncated_shard(tmp_path):
    cfg = jsonl_config(tmp_path, tokenizer="bpe:300")
    prepare(cfg, num_proc=1, progress=False, log=lambda *_: None)
    m = load_manifest(cfg.data_dir)
    check_tokenizer(m, "bpe:300")
    with pytest.raises(PreparedDataError, match="tokenized with 'bpe:300', config says .*'bytes'"):
        check_tokenizer(m, "bytes")
    train_bpe(small_texts(60)[::-1] + ["other words entirely"], 300,
              tmp_path / "prepared" / "tokenizer.json")
    with pytest.raises(PreparedDataError, match="hash .* does not match the manifest"):
        make_train_iterator(cfg, process_index=0, process_count=1)
    (tmp_path / "x").mkdir()
    ok = jsonl_config(tmp_path / "x")
    prepare(ok, num_proc=1, progress=False, log=lambda *_: None)
    shard = tmp_path / "x" / "prepared" / "train-00000.array_record"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(PreparedDataError, match=r"train-00000.array_record is truncated"):
        make_train_iterator(ok, process_index=0, process_count=1)


def test_empty_source_and_missing_manifest(tmp_path):
    (tmp_path / "raw").mkdir()
    cfg = DataConfig(data_dir=str(tmp_path / "p"), source=str(tmp_path / "raw"), tokenizer="bytes")
    with pytest.raises(ValueError, match="empty directory"):
        prepare(cfg, num_proc=1, progress=False)
    with pytest.raises(PreparedDataError, match="manifest.json not found"):
        load_manifest(tmp_path / "nowhere")


def test_a_failed_prepare_leaves_no_state_and_the_corrected_run_succeeds(tmp_path):
    """A field the records lack fails the run; its data dir (and the parents it made) are
    gone, so the corrected command is not refused by a settings file of the failed one."""
    cfg = dataclasses.replace(jsonl_config(tmp_path), data_dir=str(tmp_path / "new" / "prepared"))
    with pytest.raises(ValueError, match="missing field 'content'"):
        prepare(dataclasses.replace(cfg, text_field="content"), num_proc=1, progress=False)
    assert not (tmp_path / "new").exists()
    manifest = prepare(cfg, num_proc=1, progress=False)
    assert manifest["splits"]["train"]["documents"] > 0


def test_a_failed_prepare_leaves_an_existing_dir_byte_identical(tmp_path):
    """A user's own dir: only what the failed run wrote is removed, never the user's files."""
    cfg = jsonl_config(tmp_path, text_field="content")
    own = tmp_path / "prepared"
    (own / "notes").mkdir(parents=True)
    (own / "README.txt").write_text("mine")
    (own / "notes" / "a.txt").write_text("also mine")
    before = tree_hash(own)
    with pytest.raises(ValueError, match="missing field 'content'"):
        prepare(cfg, num_proc=1, progress=False)
    assert tree_hash(own) == before


@pytest.mark.slow
def test_cli(tmp_path):
    src = write_jsonl(tmp_path / "raw.jsonl", small_texts(30))
    cmd = [sys.executable, "-m", "ode_lm", "prepare", f"--source={src}",
           "--tokenizer=bytes", f"--data_dir={tmp_path / 'out'}", "--no_progress",
           "--holdout_fraction=0.1", "--num_proc=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stdout and "train: " in out.stdout
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"]["train"]
    bad = subprocess.run(cmd[:4] + [f"--source={tmp_path / 'missing.jsonl'}"] + cmd[5:],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 1  # a run-time error (2 is for a command line that does not parse)
    assert bad.stderr.strip().count("\n") == 0 and "missing.jsonl" in bad.stderr
    assert bad.stderr.startswith("ode-lm prepare: error: ")


def test_split_warnings_never_advise_the_holdout_given_or_one_below_zero():
    """The advice names a --holdout_fraction above the one given (or none), and no lower
    one than 0.0."""
    import re

    from ode_lm.commands.prepare import split_warnings

    def warnings(train, val, fraction):
        return split_warnings({"splits": {"train": {"tokens": train},
                                          "validation": {"tokens": val}},
                               "holdout": {"fraction": fraction}})

    [train_line, _] = warnings(100, 0, 0.0)
    assert "lower --holdout_fraction" not in train_line, train_line
    for train, val, fraction in ((100_000, 10_000, 0.3), (1_000_000, 4_000, 0.05),
                                 (1_000_000, 20_000, 0.02), (100_000, 100, 0.3)):
        [line] = warnings(train, val, fraction)
        advised = re.search(r"with --holdout_fraction=([0-9.]+)$", line)
        assert advised is None or float(advised.group(1)) > fraction, line


def test_train_flags_a_data_dir_whose_source_grew(tmp_path, caplog):
    """``ensure_prepared`` (the trainer's data step) uses the data as prepared but says, in
    one warning, that its source changed since: nothing silently left out."""
    import json
    import logging

    from ode_lm.data import DataConfig, ensure_prepared

    src = tmp_path / "a.jsonl"
    docs = [json.dumps({"text": f"document {i} about solvers"}) + "\n" for i in range(60)]
    src.write_text("".join(docs[:20]))
    cfg = DataConfig(source=str(src), tokenizer="bytes", data_dir=str(tmp_path / "d"),
                     holdout_fraction=0.1)
    first = ensure_prepared(cfg)
    src.write_text("".join(docs))
    with caplog.at_level(logging.WARNING, logger="ode_lm"):
        again = ensure_prepared(cfg)
        ensure_prepared(cfg)  # said once
    assert again["splits"] == first["splits"]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and f"whose file {src} changed since" in said[0], said
    assert "the data as prepared is used" in said[0]
