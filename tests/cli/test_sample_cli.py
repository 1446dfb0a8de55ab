"""``ode-lm sample`` end to end on a saved run: text and speed, fixed-grid and adaptive."""

from __future__ import annotations

import json
import os

import pytest
from export_helpers import make_run, tiny_config

from ode_lm.commands import sample
from ode_lm.data import DataConfig, ensure_prepared


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
