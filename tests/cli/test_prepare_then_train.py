"""README's "prepare your own corpus" leads to a run: its two commands, as written there (paths
swapped for a temporary corpus of a few hundred small documents, tiny step counts added),
prepare the corpus and train the demo's model on it; a held-out part too small for the demo's
eval is named in one warning line with the --holdout_fraction that would do."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import terminal
from data_helpers import cli_env

from ode_lm.commands import prepare as prepare_cmd

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TINY = ["--gin.TRAIN_STEPS=2", "--gin.TrainConfig.eval_solves=()",
        "--gin.TrainConfig.eval_solves=()", "--gin.DataConfig.eval_max_batches=1",
        "--gin.MeshConfig.ici_parallelism=(-1, 1, 1)"]


def readme_commands() -> list[list[str]]:
    """The commands of README's task 7, each as argv (continuation lines joined)."""
    text = (REPO / "README.md").read_text()
    block = text[text.index("# 7. prepare your own corpus"):text.index("# 8.")]
    lines = [line for line in block.replace("\\\n", " ").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    return [shlex.split(line) for line in lines]


def corpus(root: Path, n: int = 400) -> None:
    """``n`` small documents in two jsonl files, varied enough to train a BPE on."""
    words = ("solver step vector field time layer depth token model train eval data ode "
             "euler midpoint adaptive error tolerance batch sequence width head").split()
    root.mkdir()
    for part in range(2):
        with open(root / f"part{part}.jsonl", "w") as f:
            for i in range(part, n, 2):
                doc = " ".join(words[(i * 7 + j * (i % 5 + 1)) % len(words)]
                               for j in range(40 + i % 60))
                f.write(json.dumps({"text": f"Document {i}. {doc}."}) + "\n")


def _run(tmp: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = cli_env(tmp / "xla_cache")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "ode_lm", *argv[1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_readme_prepare_then_train_on_your_own_corpus(tmp_path):
    corpus(tmp_path / "my_corpus")
    prepare, train = [[a.replace("/tmp/ode_lm/", f"{tmp_path}/").replace(
        "=my_corpus/", f"={tmp_path}/my_corpus/") for a in argv] for argv in readme_commands()]
    assert f"--source={tmp_path}/my_corpus/*.jsonl" in prepare, prepare
    assert prepare[:2] == ["ode-lm", "prepare"] and train[:2] == ["ode-lm", "train"]
    proc = _run(tmp_path, [*prepare, "--no_progress", "--num_proc=1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run(tmp_path, [*train, *TINY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data/unigram_entropy: " in proc.stdout
    assert (tmp_path / "runs" / "my_corpus" / "metrics.jsonl").is_file()


def test_prepare_warns_in_one_line_when_the_held_out_part_is_too_small(tmp_path):
    corpus(tmp_path / "my_corpus", n=300)
    argv = ["ode-lm", "prepare", f"--source={tmp_path / 'my_corpus'}", "--tokenizer=bytes",
            f"--data_dir={tmp_path / 'data'}", "--holdout_fraction=0.01", "--num_proc=1"]
    proc = _run(tmp_path, argv)  # with its progress bar: the warning is still a whole line
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("ode-lm prepare: warning: split 'validation' has ")
    suggested = float(re.search(r"--holdout_fraction=([0-9.]+)$", warnings[0]).group(1))
    redo = _run(tmp_path, [*argv[:4], f"--data_dir={tmp_path / 'data2'}",
                           f"--holdout_fraction={suggested}", "--num_proc=1", "--no_progress"])
    assert redo.returncode == 0 and "warning" not in redo.stderr, redo.stderr
    manifest = json.loads((tmp_path / "data2" / "manifest.json").read_text())
    row = prepare_cmd.DEMO_BATCH_SIZE * (prepare_cmd.DEMO_SEQ_LEN + 1)
    assert manifest["splits"]["validation"]["tokens"] >= prepare_cmd.DEMO_EVAL_BATCHES * row


def test_the_demo_figures_prepare_warns_by_are_the_demo_configs():
    from ode_lm import gin_setup

    gin_setup.parse_gin(gin_setup.GinFlags(files=["configs/runs/demo.gin"]))
    data = gin_setup.GinDataConfig()
    assert (data.eval_max_batches, data.global_batch_size, data.seq_len) == (
        prepare_cmd.DEMO_EVAL_BATCHES, prepare_cmd.DEMO_BATCH_SIZE, prepare_cmd.DEMO_SEQ_LEN)


def test_prepare_refuses_a_data_dir_whose_source_changed(tmp_path):
    """A data dir records its source files' sizes and times: a jsonl grown from 50 to 250
    documents, or a file added to the source directory, is refused in one line (exit 1),
    never reported with the old counts; the data dir is left as it was."""
    from data_helpers import tree_hash

    src = tmp_path / "src"
    src.mkdir()
    docs = [json.dumps({"text": f"document {i} on solvers and steps"}) + "\n"
            for i in range(250)]
    (src / "a.jsonl").write_text("".join(docs[:50]))
    data = tmp_path / "data"
    argv = ["ode-lm", "prepare", f"--source={src}", "--tokenizer=bytes", f"--data_dir={data}",
            "--no_progress", "--holdout_fraction=0.1"]
    assert _run(tmp_path, argv).returncode == 0
    before = tree_hash(data)
    for change, said in ((lambda: (src / "a.jsonl").write_text("".join(docs)),
                          f"whose file {src / 'a.jsonl'} changed since"),
                         (lambda: (src / "b.jsonl").write_text(docs[0]),
                          f"which now also holds {src / 'b.jsonl'}")):
        if said.startswith("which"):  # a file added: the first file back as it was
            (src / "a.jsonl").write_text("".join(docs[:50]))
            os.utime(src / "a.jsonl", ns=tuple(json.loads((data / "manifest.json").read_text())
                                             ["source"]["file_stamps"][str(src / "a.jsonl")][1:]
                                             * 2))
        change()
        r = _run(tmp_path, argv)
        err = r.stderr.strip()
        assert r.returncode == 1, (r.stdout, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"ode-lm prepare: error: {data} was prepared from "), err
        assert said in err and "new documents would not be read" in err, err
        assert r.stdout == "", r.stdout  # no old counts
        assert tree_hash(data) == before


def test_ctrl_c_in_prepare_is_one_line_and_130(tmp_path):
    """Ctrl-C pressed as a terminal does (the whole process group, workers included): one
    stderr line, no worker's traceback, exit 130; the finished chunks stay for the rerun."""
    import shutil
    import signal
    import time

    script = shutil.which("ode-lm") or pytest.skip("the ode-lm script is not on PATH")
    src = tmp_path / "big.jsonl"
    line = json.dumps({"text": "a vector field integrated over depth, step by step " * 4})
    src.write_text((line + "\n") * 200_000)
    env = cli_env(tmp_path / "xla_cache")
    proc = subprocess.Popen([script, "prepare", f"--source={src}", "--tokenizer=bytes",
                             f"--data_dir={tmp_path / 'data'}", "--num_proc=2",
                             "--docs_per_shard=2000", "--no_progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=terminal.foreground)
    first = tmp_path / "data" / "chunks" / "00000.json"
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # a chunk finished: the pool runs, the rest is still to come
    assert proc.poll() is None, ("finished before the Ctrl-C: give it more work",
                                 proc.communicate())
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, (proc.returncode, out[-2000:], err[-3000:])
    assert [x for x in err.splitlines() if x.strip()] == ["ode-lm prepare: stopped by Ctrl-C"], \
        err[-3000:]
