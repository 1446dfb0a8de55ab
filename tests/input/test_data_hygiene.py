"""Data hygiene: skipped source files, damaged data dirs, configured-vs-prepared settings and
the eval split, each refused with one line naming the file/field and the data dir untouched."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import subprocess
import sys

import pytest
from data_helpers import MICRO_MODEL_GIN, small_texts, take, write_jsonl

from ode_lm.data import (
    DataConfig,
    PreparedDataError,
    SourceError,
    check_eval_split,
    ensure_prepared,
    load_manifest,
    make_eval_iterator,
    make_train_iterator,
    prepare,
)
from ode_lm.data.sources import SkippedFiles, iter_documents

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = {"num_proc": 1, "progress": False, "log": lambda *_: None}


def snapshot(root) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), root):
            hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(root) for f in files}


def one_line(e: BaseException) -> str:
    text = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in text, text
    return text


def messy_dir(tmp_path):
    """A directory corpus with good files, two empty ones and two unreadable ones."""
    raw = tmp_path / "raw"
    (raw / "sub").mkdir(parents=True)
    (raw / "a.txt").write_text("first document\nwith two lines")
    (raw / "empty.txt").write_text("")
    (raw / "sub" / "blank.txt").write_text("  \n\n ")
    write_jsonl(raw / "b.jsonl", small_texts(20))
    (raw / "broken.jsonl.gz").write_bytes(b"this is not gzip data at all")
    (raw / "bad.parquet").write_bytes(b"PAR1 garbage, not a parquet file")
    return raw


def test_empty_and_unreadable_files_are_skipped_and_counted(tmp_path, caplog):
    raw = messy_dir(tmp_path)
    cfg = DataConfig(data_dir=str(tmp_path / "p"), source=str(raw), tokenizer="bpe:300",
                     holdout_fraction=0.2, docs_per_shard=8)
    with caplog.at_level(logging.WARNING, logger="ode_lm.data"):
        m = prepare(cfg, **QUIET)  # two passes over the source (BPE training, then shards)
    sk = m["skipped_files"]
    assert (sk["empty"], sk["unreadable"]) == (2, 2)
    assert sk["files"] == {str(raw / "bad.parquet"): "unreadable",
                           str(raw / "broken.jsonl.gz"): "unreadable",
                           str(raw / "empty.txt"): "empty",
                           str(raw / "sub" / "blank.txt"): "empty"}
    docs = sum(m["splits"][s]["documents"] for s in ("train", "validation"))
    assert docs == 1 + 20
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 4, warned  # once per file, although the source is read twice
    assert any("empty.txt" in w for w in warned) and any("bad.parquet" in w for w in warned)
    assert ensure_prepared(cfg)["skipped_files"] == sk


def test_truncated_gzip_keeps_the_documents_before_the_damage(tmp_path):
    texts = small_texts(400)
    data = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    skipped = SkippedFiles()
    got = [t for t, _ in iter_documents(str(tmp_path), skipped=skipped)]
    assert 0 < len(got) < len(texts) and got == texts[: len(got)]
    kind, why = skipped.reasons[str(tmp_path / "cut.jsonl.gz")]
    assert kind == "unreadable" and f"after {len(got)} documents" in why


def test_source_without_documents_is_one_line_error_naming_it(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("")
    (raw / "b.txt").write_text("\n \n")
    cfg = DataConfig(data_dir=str(tmp_path / "p"), source=str(raw), tokenizer="bytes")
    with pytest.raises(SourceError) as e:
        prepare(cfg, **QUIET)
    assert f"source {str(raw)!r}: no documents (2 empty and 0 unreadable" in one_line(e)
    assert not (tmp_path / "p" / "manifest.json").exists()
    cmd = [sys.executable, "-m", "ode_lm", "prepare", f"--source={raw}",
           "--tokenizer=bytes", f"--data_dir={tmp_path / 'p2'}", "--no_progress", "--num_proc=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    errors = [ln for ln in out.stderr.splitlines() if "error" in ln]
    assert out.returncode == 1 and len(errors) == 1, out.stderr
    assert errors[0].startswith("ode-lm prepare: error: source") and str(raw) in errors[0]


def test_streaming_skips_empty_files_and_stops_on_a_source_without_documents(tmp_path, caplog):
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(4):
        write_jsonl(raw / f"part{i}.jsonl", small_texts(30)[i::4])
    (raw / "empty.jsonl").write_text("")
    (raw / "blank.jsonl").write_text("\n\n")
    cfg = DataConfig(data_dir=str(tmp_path / "dd"), source=str(raw), tokenizer="bytes",
                     streaming=True, seq_len=16, global_batch_size=2, prefetch=0,
                     shuffle_window=8, num_epochs=1)
    with caplog.at_level(logging.WARNING, logger="ode_lm.data"):
        batches = list(make_train_iterator(cfg, process_index=0, process_count=1))
    tokens = sum(int(b["loss_mask"].sum()) for b in batches)
    assert batches and tokens > 0
    assert {r.getMessage().split("): ")[-1].split(":")[0] for r in caplog.records
            if "skipped" in r.getMessage()} == {str(raw / "empty.jsonl"), str(raw / "blank.jsonl")}
    # restart from a saved position inside the stream: same batches as without the restart
    it = make_train_iterator(cfg, process_index=0, process_count=1)
    take(it, 1)
    state = it.get_state()
    again = make_train_iterator(cfg, process_index=0, process_count=1)
    again.set_state(state)
    assert [b["inputs"].tolist() for b in again] == [b["inputs"].tolist() for b in batches[1:]]
    # only empty files: refused up front (all zero bytes) or once every file was skipped
    only = tmp_path / "only"
    only.mkdir()
    (only / "a.txt").write_text("")
    bad = DataConfig(**{**cfg.__dict__, "source": str(only), "num_epochs": None})
    with pytest.raises(SourceError, match="no documents") as e:
        make_train_iterator(bad, process_index=0, process_count=1)
    assert str(only) in one_line(e)
    (only / "a.txt").write_text(" \n")
    (only / "b.jsonl").write_text("\n")
    with pytest.raises(SourceError, match=r"no documents \(2 empty") as e:
        next(make_train_iterator(bad, process_index=0, process_count=1))
    assert str(only) in one_line(e)


# ------------------------------------------------------------------ damaged data dirs


@pytest.fixture()
def prepared(tmp_path):
    src = write_jsonl(tmp_path / "raw.jsonl", small_texts(60))
    cfg = DataConfig(data_dir=str(tmp_path / "p"), source=str(src), tokenizer="bytes",
                     holdout_fraction=0.2, docs_per_shard=16, seq_len=16, global_batch_size=2,
                     prefetch=0)
    prepare(cfg, **QUIET)
    return cfg


def edit_manifest(cfg, fn) -> None:
    path = os.path.join(cfg.data_dir, "manifest.json")
    m = json.load(open(path))
    fn(m)
    with open(path, "w") as f:
        json.dump(m, f)


def refused(cfg, match, opener=ensure_prepared):
    before = snapshot(cfg.data_dir)
    with pytest.raises(PreparedDataError, match=match) as e:
        opener(cfg)
    assert snapshot(cfg.data_dir) == before
    return one_line(e)


def open_train(cfg):
    return make_train_iterator(cfg, process_index=0, process_count=1)


@pytest.mark.parametrize("opener", [ensure_prepared, open_train])
def test_corrupted_shard_refused_when_the_dir_is_opened(prepared, opener):
    shard = os.path.join(prepared.data_dir, "train-00001.array_record")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF  # same size: only the record count can tell
    open(shard, "wb").write(bytes(data))
    msg = refused(prepared, "is (unreadable|truncated) .*corrupt", opener)
    assert shard in msg


def test_truncated_shard_with_an_old_manifest_without_byte_sizes(prepared):
    def drop_bytes(m):
        for split in m["splits"].values():
            for s in split["shards"]:
                del s["bytes"]
        del m["skipped_files"]

    edit_manifest(prepared, drop_bytes)
    assert ensure_prepared(prepared)["splits"]["train"]["documents"] > 0  # old manifests load
    shard = os.path.join(prepared.data_dir, "train-00002.array_record")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-10])
    assert shard in refused(prepared, "is (unreadable|truncated) .*corrupt")
    open(shard, "wb").write(data[:1000])
    assert shard in refused(prepared, "is unreadable")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["splits"]["train"].update(tokens=m["splits"]["train"]["tokens"] + 5),
     r"splits\.train\.tokens=\d+ but its shards hold \d+"),
    (lambda m: m["splits"]["validation"]["shards"][0].update(documents=99),
     r"splits\.validation\.documents=\d+ but its shards hold \d+"),
    (lambda m: m["tokenizer"].update(vocab_size=300),
     r"tokenizer\.vocab_size=300 but the tokenizer 'bytes' \(bytes\) has vocab_size=257"),
    (lambda m: m["tokenizer"].update(vocab_size=70000),
     r"dtype='<u2' does not match tokenizer\.vocab_size=70000"),
    (lambda m: m["tokenizer"].update(eos_id=3),
     r"tokenizer\.eos_id=3 but the tokenizer 'bytes' \(bytes\) has eos_id=256"),
    (lambda m: m["splits"].pop("validation"), r"missing field 'splits\.validation\.documents'"),
])
def test_edited_manifest_refused_naming_the_field(prepared, edit, match):
    edit_manifest(prepared, edit)
    msg = refused(prepared, match)
    assert "manifest.json" in msg
    refused(prepared, match, open_train)


def test_record_count_differing_from_the_manifest(prepared):
    def one_more(m):
        train = m["splits"]["train"]
        train["documents"] += 1
        train["shards"][0]["documents"] += 1

    n = load_manifest(prepared.data_dir)["splits"]["train"]["shards"][0]["documents"]
    edit_manifest(prepared, one_more)
    msg = refused(prepared, f"truncated or corrupt: {n} records, manifest says {n + 1}")
    assert "train-00000.array_record" in msg


def test_missing_shard_and_broken_json(prepared):
    os.remove(os.path.join(prepared.data_dir, "train-00003.array_record"))
    assert "train-00003.array_record is missing" in refused(prepared, "is missing")
    with open(os.path.join(prepared.data_dir, "manifest.json"), "w") as f:
        f.write('{"format": "ode_lm.data/1", ')
    with pytest.raises(PreparedDataError, match="manifest.json: not valid JSON"):
        load_manifest(prepared.data_dir)


# -------------------------------------------------- configured vs prepared settings


@pytest.mark.parametrize("field, value", [
    ("holdout_fraction", 0.3), ("holdout_seed", 7), ("text_field", "body"),
    ("non_utf8", "skip"), ("source", "builtin"),
])
def test_settings_differing_from_the_prepared_ones_are_refused(prepared, field, value):
    cfg = DataConfig(**{**prepared.__dict__, field: value})
    old = getattr(prepared, field)
    msg = refused(cfg, f"prepared with {field}=")
    assert f"prepared with {field}={old!r}, but DataConfig.{field}={value!r}" in msg
    refused(cfg, f"prepared with {field}=", open_train)
    refused(cfg, f"prepared with {field}=", lambda c: make_eval_iterator(c, process_index=0,
                                                                         process_count=1))


def test_settings_that_do_not_change_the_data_are_not_compared(prepared):
    # text_delimiter only splits .txt files, docs_per_shard only the shard layout; streaming
    # uses the data dir for its validation split only (the source is what it streams)
    for field, value in (("text_delimiter", "<|doc|>"), ("docs_per_shard", 5),
                         ("streaming", True)):
        ensure_prepared(DataConfig(**{**prepared.__dict__, field: value}))
    streaming = DataConfig(**{**prepared.__dict__, "streaming": True, "source": "/elsewhere"})
    ensure_prepared(streaming)
    with pytest.raises(PreparedDataError, match="prepared with holdout_seed=2357"):
        ensure_prepared(DataConfig(**{**streaming.__dict__, "holdout_seed": 1}))


# ------------------------------------------------------------------------ eval split


def test_eval_split_checked_from_the_manifest(prepared, tmp_path):
    m = ensure_prepared(prepared)
    n = check_eval_split(prepared, m, process_count=1)
    assert n == len(list(make_eval_iterator(prepared, process_index=0, process_count=1)))
    with pytest.raises(ValueError, match="eval_max_batches=0"):
        check_eval_split(DataConfig(**{**prepared.__dict__, "eval_max_batches": 0}), m,
                         process_count=1)
    with pytest.raises(ValueError, match="eval_batch_size=3 is not divisible by process_count=2"):
        check_eval_split(DataConfig(**{**prepared.__dict__, "eval_batch_size": 3}), m,
                         process_count=2)
    src = write_jsonl(tmp_path / "raw2.jsonl", small_texts(10))
    none = DataConfig(data_dir=str(tmp_path / "none"), source=str(src), tokenizer="bytes",
                      holdout_fraction=0.0)
    with pytest.raises(PreparedDataError, match="'validation' split is empty .*"
                       r"holdout_fraction=0\.0") as e:
        check_eval_split(none, ensure_prepared(none), process_count=1)
    assert "none/manifest.json" in one_line(e)


def test_trainer_refuses_an_empty_validation_split_before_any_step(tmp_path, capsys):
    from ode_lm.commands.train import main

    src = write_jsonl(tmp_path / "raw.jsonl", small_texts(40))
    model_dir = tmp_path / "run"
    gin = tmp_path / "run.gin"
    gin.write_text(f"""{MICRO_MODEL_GIN}SEQ_LEN = 16
BATCH_SIZE = 8
VOCAB_SIZE = 384
DATA_DIR = '{tmp_path / "data"}'
DataConfig.source = '{src}'
DataConfig.holdout_fraction = 0.0
train.model_dir = '{model_dir}'
train.num_train_steps = 2
MeshConfig.ici_parallelism = (-1, 1, 1)
""")
    assert main([f"--gin_file={gin}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "'validation' split is empty" in err and "manifest.json" in err, err
    ckpts = model_dir / "checkpoints"
    assert not ckpts.exists() or not any(p.name.isdigit() for p in ckpts.iterdir())
    data_before = snapshot(tmp_path / "data")
    # a data dir prepared earlier with another holdout: refused, naming the field, untouched
    assert main([f"--gin_file={gin}", "--gin.DataConfig.holdout_fraction=0.2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "prepared with holdout_fraction=0.0, but DataConfig.holdout_fraction=0.2" in err, err
    assert snapshot(tmp_path / "data") == data_before


@pytest.mark.parametrize("field, value, message", [
    ("source", "{tmp}/nope.jsonl", "no such file or directory"),
    ("tokenizer", "nope:1", "unknown tokenizer spec 'nope:1'"),
    ("tokenizer", "bpe:12", "bpe vocab size must be in"),
])
def test_refused_preparation_makes_no_data_dir(tmp_path, field, value, message):
    """A source that does not exist or a tokenizer that cannot work is refused before the
    data dir is created (a half-made dir would then be 'prepared with other settings')."""
    import dataclasses

    from ode_lm.data import DataConfig
    from ode_lm.data.prepare import prepare

    cfg = DataConfig(source="builtin", tokenizer="bytes", data_dir=str(tmp_path / "new"))
    cfg = dataclasses.replace(cfg, **{field: value.format(tmp=tmp_path)})
    with pytest.raises((ValueError, OSError), match=message):
        prepare(cfg, progress=False)
    assert not (tmp_path / "new").exists()
