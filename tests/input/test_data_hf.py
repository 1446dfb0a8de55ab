"""hf://datasets/<repo>[/<glob>] sources, read through fsspec's ``hf`` file system.

This machine cannot reach the hub, so each test registers a stand-in for the ``hf`` protocol
(``fsspec.register_implementation(..., clobber=True)``): a ``DirFileSystem`` over a local
folder laid out like the hub (``datasets/<owner>/<name>/...``), which answers ``glob``,
``find``, ``isdir``, ``size`` and ``open`` with the hub's path form (no protocol, no leading
slash), as ``huggingface_hub.HfFileSystem`` does. Everything above it is the real code:
listing, per-host file assignment, parquet reading, preparation and streaming.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import assert_batches_equal, small_texts, take
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from ode_lm.data import DataConfig, make_train_iterator, prepare
from ode_lm.data.pipeline import open_split
from ode_lm.data.sources import SourceError, list_files
from ode_lm.data.streaming_source import HostFiles

REPO = "hf://datasets/fake/owt"
REGISTRY = importlib.import_module("fsspec.registry")


@pytest.fixture
def hub(tmp_path):
    """A local stand-in hub with one dataset repo: four parquet files under plain_text/ plus
    the metadata a real repo holds (README.md, a json that is not a jsonl of documents)."""
    root = tmp_path / "hub"
    data = root / "datasets" / "fake" / "owt" / "plain_text"
    data.mkdir(parents=True)
    texts = small_texts(160)
    for i in range(4):
        pq.write_table(pa.table({"text": texts[i::4]}), data / f"train-{i:05d}-of-00004.parquet",
                       row_group_size=7)
    (data.parent / "README.md").write_text("---\nlicense: cc0\n---\n")
    (data.parent / "dataset_infos.json").write_text('{"plain_text": {}}')
    opened: list[str] = []

    class StandInHub(DirFileSystem):
        protocol = "hf"
        cachable = False  # a fresh stand-in per test, never a cached one from another

        def __init__(self, **kwargs):
            super().__init__(path=str(root), fs=LocalFileSystem(), **kwargs)

        def open(self, path, *args, **kwargs):
            opened.append(path)
            return super().open(path, *args, **kwargs)

    before = REGISTRY._registry.get("hf")
    fsspec.register_implementation("hf", StandInHub, clobber=True)
    yield data, opened
    REGISTRY._registry.pop("hf", None)
    if before is not None:
        fsspec.register_implementation("hf", before, clobber=True)


def test_the_stand_in_replaces_the_class_production_uses():
    hf = pytest.importorskip("huggingface_hub")
    assert fsspec.get_filesystem_class("hf") is hf.HfFileSystem


def test_listing_repo_dir_glob_and_file(hub):
    data, _ = hub
    names = [f"{REPO}/plain_text/train-{i:05d}-of-00004.parquet" for i in range(4)]
    assert list_files(REPO) == names  # the repo: its parquet files only, sorted
    assert list_files(REPO + "/plain_text/") == names
    assert list_files(REPO + "/plain_text/train-0000[02]-*.parquet") == names[::2]
    assert list_files(names[3]) == names[3:]
    assert list_files(f"{names[1]},{REPO}/*/*-00000-*") == [names[0], names[1]]
    with pytest.raises(SourceError, match=r"^source 'hf://datasets/fake/nope': no such repo"):
        list_files("hf://datasets/fake/nope")
    with pytest.raises(SourceError, match=r"expected hf://datasets/<owner>/<name>\[/<path glob"):
        list_files("hf://openwebtext")
    with pytest.raises(SourceError, match=r"plain_text/\*\.jsonl': the glob matches no files$"):
        list_files(REPO + "/plain_text/*.jsonl")
    for p in data.iterdir():
        p.unlink()
    with pytest.raises(SourceError, match=r"'hf://datasets/fake/owt': no \.parquet files in it$"):
        list_files(REPO)


def test_prepare_from_the_hub_gives_the_local_tokens(hub, tmp_path):
    data, opened = hub
    kw = {"tokenizer": "bytes", "holdout_fraction": 0.2, "docs_per_shard": 32, "prefetch": 0,
          "seq_len": 16, "global_batch_size": 2}
    local = DataConfig(data_dir=str(tmp_path / "local"), source=str(data), **kw)
    remote = DataConfig(data_dir=str(tmp_path / "remote"), source=REPO + "/plain_text/*.parquet",
                        **kw)
    quiet = {"num_proc": 1, "progress": False, "log": lambda *_: None}
    m_local, m_remote = prepare(local, **quiet), prepare(remote, **quiet)
    assert m_remote["source"]["files"] == [f"{REPO}/plain_text/{p.name}"
                                           for p in sorted(data.iterdir())]
    assert sorted(set(opened)) == m_remote["source"]["files"]  # read through the hf file system
    for split in ("train", "validation"):
        a, b = open_split(local, split)[1], open_split(remote, split)[1]
        assert len(a) == len(b) == m_remote["splits"][split]["documents"] > 0
        for i in range(len(a)):
            np.testing.assert_array_equal(a[i], b[i])
        assert m_local["splits"][split]["tokens"] == m_remote["splits"][split]["tokens"]


def stream_config(source: str, tmp_path, **kw) -> DataConfig:
    kw = {"tokenizer": "bytes", "streaming": True, "seq_len": 64, "global_batch_size": 4,
          "shuffle_window": 16, "interleave_files": 2, "prefetch": 0, **kw}
    return DataConfig(data_dir=str(tmp_path / "dd"), source=source, **kw)


def test_streaming_from_the_hub_equals_the_local_files(hub, tmp_path):
    data, opened = hub
    remote, local = stream_config(REPO, tmp_path), stream_config(str(data), tmp_path)
    a = take(make_train_iterator(remote, process_index=0, process_count=1), 8)
    assert_batches_equal(a, take(make_train_iterator(local, process_index=0, process_count=1), 8))
    assert opened and all(p.startswith(REPO + "/plain_text/") for p in opened)


def test_two_hosts_stream_disjoint_hub_files(hub, tmp_path):
    data, opened = hub
    files = list_files(REPO)
    cfg = stream_config(REPO, tmp_path, num_epochs=1, interleave_files=1)
    per_host = []
    for p in range(2):
        host = HostFiles(files, cfg.seed, p, 2, 1)
        mine = {host[f] for f in range(host.per_epoch)}
        opened.clear()
        remote = list(make_train_iterator(cfg, process_index=p, process_count=2))
        assert set(opened) == mine  # this host opened its own files and no other
        local = list(make_train_iterator(dataclasses.replace(cfg, source=str(data)),
                                         process_index=p, process_count=2))
        assert_batches_equal(remote, local)
        per_host.append(mine)
    assert per_host[0].isdisjoint(per_host[1]) and per_host[0] | per_host[1] == set(files)
    assert len(per_host[0]) == len(per_host[1]) == 2


def test_without_huggingface_hub_the_error_names_the_extra(monkeypatch):
    monkeypatch.delitem(REGISTRY._registry, "hf", raising=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(SourceError, match=r"^source 'hf://datasets/a/b': hf:// sources need "
                                          r"huggingface_hub \(pip install 'ode-lm\[hub\]'\)$"):
        list_files("hf://datasets/a/b")
