"""``ode-lm sample`` end to end on a saved run: text and speed, fixed-grid and adaptive."""

from __future__ import annotations

import json
import os

import pytest
from export_helpers import make_run, tiny_config

from ode_lm.commands import sample
from ode_lm.data import DataConfig, ensure_prepared
from ode_lm.training.run_dir import RunDir


@pytest.mark.slow
def test_sample_cli_prints_text_and_speed(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"doc {i} about solvers"}) for i in range(20)))
    data = DataConfig(source=str(docs), tokenizer="bytes", data_dir=str(tmp_path / "data"),
                      holdout_fraction=0.2)
    ensure_prepared(data)
    run = str(tmp_path / "run")
    make_run(run, tiny_config("llama", vocab_size=384, num_steps=2))
    with open(os.path.join(run, "config.gin"), "w") as f:
        f.write(f"DataConfig.data_dir = '{data.data_dir}'\n")
    rc = sample.main([f"--model_dir={run}", "--prompt=The ODE", "--prompt=x", "--num_steps=3",
                      "--max_new_tokens=4", "--temperature=0", "--solver=midpoint"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens/s" in out and "M=3" in out
    assert "\nThe ODE" in out  # each continuation starts with its prompt
    rc = sample.main([f"--model_dir={run}", "--prompt=The ODE", "--max_new_tokens=3",
                      "--temperature=0", "--solver=adaptive", "--rtol=1e-2", "--no_timing"])
    out = capsys.readouterr().out
    assert rc == 0 and "adaptive rtol=0.01" in out and out.startswith("The ODE")
    assert sample.main([f"--model_dir={run}", "--prompt=a", "--num_steps=0"]) == 2  # a flag
    assert "--num_steps=0" in capsys.readouterr().err


@pytest.mark.slow
def test_sample_cli_self_speculative_per_k_and_auto(tmp_path, capsys):
    """``--draft``: one line per k with acceptance, tokens/s against plain decoding and
    identity (greedy), the same in ``--json``; ``--draft=auto`` says what it picked (or
    that plain decoding is faster) and decodes."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"doc {i} about solvers"}) for i in range(20)))
    data = DataConfig(source=str(docs), tokenizer="bytes", data_dir=str(tmp_path / "data"),
                      holdout_fraction=0.2, seq_len=16, eval_batch_size=2)
    ensure_prepared(data)
    run = str(tmp_path / "run")
    make_run(run, tiny_config("llama", vocab_size=384, num_steps=4))
    RunDir(run).write_data_config(data)  # as the trainer records it: --draft=auto reads it
    spec = tmp_path / "spec.json"
    rc = sample.main([f"--model_dir={run}", "--prompt=The ODE", "--prompt=x", "--temperature=0",
                      "--max_new_tokens=6", "--draft=euler:1", "--draft_tokens=1,3",
                      f"--json={spec}"])
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if " -> verify euler:4 " in x]
    assert rc == 0 and len(lines) == 2, out
    assert all("acceptance" in x and "tokens/s against plain" in x and
               x.endswith("identical to plain") for x in lines), lines
    rows = json.loads(spec.read_text())["rows"]
    assert [r["draft_tokens"] for r in rows] == [1, 3]
    assert all(r["identical"] and r["speedup"] > 0 and 0 <= r["acceptance"] <= 1
               for r in rows)
    rc = sample.main([f"--model_dir={run}", "--prompt=The ODE", "--temperature=0",
                      "--max_new_tokens=4", "--draft=auto"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("--draft=auto: "), (out, err)
    assert "from the timed forwards" in out.splitlines()[0]
