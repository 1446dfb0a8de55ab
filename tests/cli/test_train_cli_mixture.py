"""Exact resume after SIGKILL on a two-component mixture whose weights change in the middle
of the run, and its per-component figures: the subprocess harness of train_cli_helpers with
a mixture in place of the single prepared source."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import train_cli_helpers as cli

from ode_lm.training.run_dir import RunDir

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def mixture_gin(data_root: Path) -> str:
    """The built-in corpus in halves; 80/20 for the first K steps, then 25/75."""
    return f"""
DataConfig.mixture = {{
    'even': {{'source': 'builtin:part=0/2', 'data_dir': '{data_root / "even"}'}},
    'odd': {{'source': 'builtin:part=1/2', 'data_dir': '{data_root / "odd"}'}},
}}
DataConfig.mixture_weights = [(0, {{'even': 0.8, 'odd': 0.2}}),
                              ({cli.K}, {{'even': 0.25, 'odd': 0.75}})]
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_cli_mixture")


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    return cli.reference_run(workdir, mixture_gin(workdir / "mixture"))[0]


def test_mixture_run_logs_tokens_and_evaluates_each_component(reference):
    rows = [json.loads(line) for line in Path(RunDir(str(reference)).metrics).read_text()
            .splitlines()]
    train = [r for r in rows if "train/loss" in r]
    last = train[-1]
    assert last["data/even/tokens"] + last["data/odd/tokens"] == 2 * cli.K * 8 * 32
    odd = [r["data/odd/tokens"] for r in train]
    assert odd == sorted(odd)  # cumulative
    evals = [r for r in rows if "eval/loss" in r]
    for c in ("even", "odd"):  # at the run's own N and at every other evaluated setting
        assert {f"eval/{c}/perplexity", f"eval/{c}/perplexity@steps=4"} <= set(evals[-1])


def test_exact_resume_after_sigkill_across_a_weight_change(workdir, reference):
    """Killed at or before the weight change at step K, resumed across it."""
    cli.kill_and_resume(workdir, reference, mixture_gin(workdir / "mixture"))


def test_the_mixture_demo_reports_each_components_unigram_entropy(workdir):
    """runs/demo.gin with data/mixture_demo.gin (tiny steps): exit 0, and the corpus
    yardstick is each component's, read from its own data dir (not the single-source dir the
    demo binds, prepared with another tokenizer)."""
    model_dir, data = workdir / "mixture_demo", workdir / "mixture_demo_data"
    flags = ["--gin_file=configs/runs/demo.gin", "--gin_file=configs/data/mixture_demo.gin",
             f"--gin.MODEL_DIR={model_dir}", f"--gin.EVEN_DIR={data / 'even'}",
             f"--gin.ODD_DIR={data / 'odd'}", "--gin.TRAIN_STEPS=2", "--gin.SEQ_LEN=32",
             "--gin.D_MODEL=32", "--gin.VOCAB_SIZE=512", "--gin.TrainConfig.eval_solves=()",
             "--gin.TrainConfig.eval_solves=()", "--gin.DataConfig.eval_max_batches=1",
             "--gin.MeshConfig.ici_parallelism=(-1, 1, 1)"]
    proc = subprocess.run([sys.executable, "-m", "ode_lm", "train", *flags], cwd=REPO,
                          env=cli._env(workdir / "xla_cache"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for component in ("even", "odd"):
        line = next(x for x in proc.stdout.splitlines()
                    if x.startswith(f"data/{component}/unigram_entropy: "))
        assert 1.0 < float(line.split(": ")[1]) < math.log(257)  # bytes: at most ln 257 nats
    assert "data/unigram_entropy" not in proc.stdout
    assert RunDir(str(model_dir)).data_dir() == str(data / "even")  # its tokenizer's dir
