"""tools/fortunes_corpus.sh: the real-English corpus of one Debian package, fetched and
prepared with the documented commands on a slice of two files. Skipped where there is no
apt-get (not Debian or Ubuntu) or the package cannot be downloaded (no network)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ode_lm.data import DataConfig, prepare
from ode_lm.data.pipeline import open_split

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "fortunes_corpus.sh"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        pytest.skip("needs apt-get and dpkg-deb")
    out = tmp_path_factory.mktemp("fortunes") / "txt"
    run = subprocess.run(["bash", str(SCRIPT), str(out), "wisdom", "science"],
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "download fortunes failed" in run.stderr:
        pytest.skip(f"the package could not be downloaded: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr
    return out


def test_the_slice_is_english_prose_one_fortune_per_document(corpus, tmp_path):
    assert sorted(p.name for p in corpus.iterdir()) == ["science.txt", "wisdom.txt"]
    text = (corpus / "wisdom.txt").read_text()
    assert text.count("\n%\n") > 100 and " the " in text
    cfg = DataConfig(data_dir=str(tmp_path / "prepared"), source=str(corpus),
                     text_delimiter="\n%\n", tokenizer="bytes", holdout_fraction=0.1,
                     docs_per_shard=256, prefetch=0, seq_len=64, global_batch_size=2)
    manifest = prepare(cfg, num_proc=1, progress=False)
    docs = sum(s["documents"] for s in manifest["splits"].values())
    assert docs > 500 and manifest["splits"]["validation"]["documents"] > 10
    _, records = open_split(cfg, "validation")
    assert len(records) > 0


def test_the_script_refuses_a_bad_call(tmp_path):
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: tools/fortunes_corpus.sh")


def test_an_unknown_file_is_named(corpus, tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "o"), "no-such-file"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "no fortune file no-such-file" in run.stderr
    assert json.dumps(run.stderr).count("\\n") == 1  # one line
