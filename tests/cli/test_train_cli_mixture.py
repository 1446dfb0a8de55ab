"""Exact resume after SIGKILL on a two-component mixture whose weights change in the middle
of the run, and its per-component figures: the subprocess harness of train_cli_helpers with
a mixture in place of the single prepared source."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
import train_cli_helpers as cli

from ode_lm.training.run_dir import RunDir

pytestmark = pytest.mark.slow


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


def write_gin(workdir: Path, name: str, model_dir: Path) -> Path:
    path = cli.write_gin(workdir, name, model_dir)
    path.write_text(path.read_text() + mixture_gin(workdir / "mixture"))  # later bindings win
    return path


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    model_dir = workdir / "reference"
    rc, out, err = cli.run(workdir, write_gin(workdir, "reference", model_dir))
    assert rc == 0, err[-3000:]
    return model_dir


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
    model_dir = workdir / "killed"
    gin_file = write_gin(workdir, "killed", model_dir)
    rng = random.Random()
    kill_after = rng.randint(1, cli.K)  # at or before the weight change at step K
    proc = cli.start(workdir, gin_file)
    deadline = time.time() + 600
    while max(cli.checkpoint_steps(model_dir), default=0) < kill_after and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.1))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = cli.checkpoint_steps(model_dir)
    assert killed_at and killed_at[-1] < 2 * cli.K, (killed_at, proc.stderr.read()[-3000:])
    rc, out, err = cli.run(workdir, gin_file)
    assert rc == 0, err[-3000:]
    assert "resumed from step" in out
    assert cli.losses(model_dir) == cli.losses(reference)
    cli.assert_same_params(reference, model_dir)
