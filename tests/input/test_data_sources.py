"""Raw sources: built-in corpus, text, jsonl(.gz/.zst), parquet, TFDS; and bad input."""

from __future__ import annotations

import gzip
import json

import pytest
from data_helpers import small_texts, write_jsonl

from ode_lm.data import corpus
from ode_lm.data.sources import SourceError, iter_documents, list_files


def test_builtin_corpus_is_deterministic_english():
    docs = corpus.builtin_documents()
    size = sum(len(d.encode()) for d in docs)
    assert 1.0e6 < size < 2.5e6 and len(docs) > 3000
    assert sum(d.count(" the ") for d in docs) > 5000  # English prose, not code
    # the same extraction again from source files gives the same documents in the same order
    files = corpus._module_files(corpus.stdlib_root())
    assert files == sorted(files, key=lambda p: p.relative_to(corpus.stdlib_root()).as_posix())
    redo = [d for f in files[:25] for d in corpus._docstrings(f.read_bytes())]
    assert list(docs[: len(redo)]) == redo
    assert [t for t, _ in iter_documents("builtin")][:5] == list(docs[:5])


def test_text_files_one_per_file_and_delimited(tmp_path):
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.txt").write_text("first\n<|doc|>\nsecond\n<|doc|>\n\n")
    assert [t for t, _ in iter_documents(str(tmp_path))] == ["first\n<|doc|>\nsecond\n<|doc|>\n\n",
                                                               "second file"]
    got = [t for t, _ in iter_documents(str(tmp_path), text_delimiter="<|doc|>")]
    assert got == ["first", "second", "second file"]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_plain_and_compressed(tmp_path, suffix):
    import zstandard

    texts = small_texts(20)
    raw = "".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    path = tmp_path / f"docs{suffix}"
    if suffix.endswith(".gz"):
        raw = gzip.compress(raw)
    elif suffix.endswith(".zst"):
        raw = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(raw)
    assert [t for t, _ in iter_documents(str(path), text_field="body")] == texts


def test_parquet_openwebtext_layout(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = small_texts(30)
    pq.write_table(pa.table({"text": texts}), tmp_path / "train-00000-of-00001.parquet",
                   row_group_size=7)
    assert [t for t, _ in iter_documents(str(tmp_path / "*.parquet"))] == texts
    with pytest.raises(SourceError, match=r"missing column 'content' \(columns: \['text'\]\)"):
        list(iter_documents(str(tmp_path), text_field="content"))


def test_glob_and_sorted_order(tmp_path):
    for name in ("c", "a", "b"):
        write_jsonl(tmp_path / f"{name}.jsonl", [name])
    assert [f.rsplit("/", 1)[1] for f in list_files(str(tmp_path / "*.jsonl"))] == [
        "a.jsonl", "b.jsonl", "c.jsonl"]
    assert [t for t, _ in iter_documents(f"{tmp_path}/c.jsonl,{tmp_path}/a.jsonl")] == ["a", "c"]


def test_non_utf8_bytes_are_replaced_and_flagged(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok \xff\xfe bytes"}\n{"text": "fine"}\n')
    docs = list(iter_documents(str(tmp_path / "bad.jsonl")))
    assert docs == [("ok \ufffd\ufffd bytes", True), ("fine", False)]
    (tmp_path / "surrogate.jsonl").write_text('{"text": "lone \\udc80 surrogate"}\n')
    assert list(iter_documents(str(tmp_path / "surrogate.jsonl")))[0][1] is True


@pytest.mark.parametrize("make, match", [
    (lambda d: (d / "empty.jsonl").write_text(""), r"empty\.jsonl: empty file"),
    (lambda d: (d / "empty.txt").write_text(""), r"empty\.txt: empty file"),
    (lambda d: (d / "sub").mkdir(), r"empty directory"),
    (lambda d: (d / "x.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n'),
     r"x\.jsonl:2: missing field 'text'"),
    (lambda d: (d / "x.jsonl").write_text('{"text": "a"}\n{broken\n'),
     r"x\.jsonl:2: invalid JSON"),
    (lambda d: (d / "x.csv").write_text("a,b"), r"x\.csv: unsupported file type"),
])
def test_bad_input_errors_name_the_file(tmp_path, make, match):
    make(tmp_path)
    target = {"empty directory": tmp_path / "sub"}.get(match, tmp_path)
    if "csv" in match:
        target = tmp_path / "x.csv"  # given explicitly; directories list only known types
    with pytest.raises(SourceError, match=match):
        list(iter_documents(str(target)))


def test_missing_path_and_glob(tmp_path):
    with pytest.raises(SourceError, match="no such file or directory"):
        list(iter_documents(str(tmp_path / "nope")))
    with pytest.raises(SourceError, match="glob matches no files"):
        list(iter_documents(str(tmp_path / "*.parquet")))


def test_tfds_data_source_built_locally(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    class TinyOdeText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, t in enumerate(small_texts(25)):
                yield i, {"text": t}

    TinyOdeText(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    docs = list(iter_documents(f"tfds:tiny_ode_text?split=train&data_dir={tmp_path}"))
    assert sorted(t for t, _ in docs) == sorted(small_texts(25))
    assert not any(bad for _, bad in docs)
    with pytest.raises(SourceError, match="tfds.data_source failed"):
        list(iter_documents(f"tfds:no_such_dataset?data_dir={tmp_path}"))


def test_gs_paths_through_epath(tmp_path):
    """gs:// sources go through etils.epath (mocked onto a local folder here)."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq
    from etils.epath import testing

    from ode_lm.data import DataConfig, prepare

    (tmp_path / "raw").mkdir()
    write_jsonl(tmp_path / "raw" / "a.jsonl", small_texts(5))
    pq.write_table(pa.table({"text": small_texts(9)[5:]}), tmp_path / "raw" / "b.parquet")
    local = str(tmp_path)

    def remap(fn, path, *a, **k):
        return fn(os.fspath(path).replace("gs://bucket", local), *a, **k)

    def remap_glob(fn, path, *a, **k):
        return [p.replace(local, "gs://bucket") for p in remap(fn, path, *a, **k)]

    with testing.mock_epath(open=remap, exists=remap, isdir=remap, listdir=remap,
                            glob=remap_glob, stat=remap, walk=remap):
        assert list_files("gs://bucket/raw") == ["gs://bucket/raw/a.jsonl",
                                                 "gs://bucket/raw/b.parquet"]
        assert [t for t, _ in iter_documents("gs://bucket/raw/*")] == small_texts(9)
        m = prepare(DataConfig(data_dir=str(tmp_path / "out"), source="gs://bucket/raw",
                               tokenizer="bytes", holdout_fraction=0.0),
                    num_proc=1, progress=False, log=lambda *_: None)
    assert m["splits"]["train"]["documents"] == 9
