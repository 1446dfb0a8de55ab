"""Adaptive-depth fine-tuning through the CLI: modes, methods, resume, export, bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from data_helpers import FINETUNE_DATA_GIN
from export_helpers import make_run, tiny_config

from ode_lm.commands import finetune as ft
from ode_lm.data import DataConfig, ensure_prepared
from ode_lm.training.run_dir import RunDir
from ode_lm.training.saved_run import load_model

TEXT = ("The solver integrates the vector field over depth. " * 3 +
        "Each step evaluates attention and the MLP with weights generated at time t. ")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("corpus")
    path = root / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"document {i}. " + TEXT[i % 40:] + TEXT[: i % 17]})
                    + "\n")
    return str(path)


def _data(corpus: str, data_dir: str, tokenizer: str = "bytes") -> DataConfig:
    return DataConfig(source=corpus, tokenizer=tokenizer, data_dir=data_dir, seq_len=16,
                      global_batch_size=8, holdout_fraction=0.2, eval_max_batches=2)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus) -> str:
    root = tmp_path_factory.mktemp("pre")
    data = _data(corpus, str(root / "data"))
    ensure_prepared(data)
    run = str(root / "run")
    make_run(run, tiny_config("gpt2", vocab_size=384, num_steps=3))
    with open(os.path.join(run, "config.gin"), "w") as f:  # what the trainer leaves behind
        f.write(f"DATA_DIR = '{data.data_dir}'\nDataConfig.data_dir = %DATA_DIR\n")
    return run


def _gin(tmp_path, pretrained, corpus, model_dir, **over) -> str:
    v = dict(M=2, METHOD="lora", MODE="materialised", TRAIN_STEPS=3,
             DATA_DIR=os.path.join(os.path.dirname(pretrained), "data"), TOKENIZER="bytes",
             TARGETS="('qkv', 'mlp_*')")
    v.update(over)
    text = f"""
finetune.model_dir = '{model_dir}'
finetune.num_train_steps = {v['TRAIN_STEPS']}
finetune.data = @DataConfig()
FinetuneConfig.pretrained_dir = '{pretrained}'
FinetuneConfig.num_steps = {v['M']}
FinetuneConfig.method = '{v['METHOD']}'
FinetuneConfig.mode = '{v['MODE']}'
FinetuneConfig.lora_rank = 2
FinetuneConfig.lora_alpha = 4.0
FinetuneConfig.lora_targets = {v['TARGETS']}
DataConfig.source = '{corpus}'
DataConfig.tokenizer = '{v['TOKENIZER']}'
DataConfig.data_dir = '{v['DATA_DIR']}'
{FINETUNE_DATA_GIN}CheckpointConfig.save_every = 1
CheckpointConfig.async_save = False
MeshConfig.ici_parallelism = (-1, 1, 1)
"""
    path = tmp_path / f"ft_{len(os.listdir(tmp_path))}.gin"
    path.write_text(text)
    return str(path)


@pytest.mark.slow
def test_lora_materialised_trains_resumes_and_exports(tmp_path, pretrained, corpus, capsys):
    from ode_lm.export import export
    from ode_lm.training.saved_run import load_run

    out = str(tmp_path / "lora2")
    assert ft.main([f"--gin_file={_gin(tmp_path, pretrained, corpus, out)}"]) == 0
    log = capsys.readouterr().out
    assert "trainable of" in log and "%)" in log and "eval/perplexity" in log
    info = json.load(open(os.path.join(out, "finetune.json")))
    assert info["method"] == "lora" and info["mode"] == "materialised" and info["num_steps"] == 2
    config = RunDir(out).model_config()
    assert config.architecture == "parallel" and config.num_layers == 2
    assert RunDir(out).data_config().data_dir == os.path.join(os.path.dirname(pretrained), "data")
    # resume: same command with more steps continues from the saved step
    assert ft.main([f"--gin_file={_gin(tmp_path, pretrained, corpus, out, TRAIN_STEPS=4)}"]) == 0
    assert "resumed from step 3" in capsys.readouterr().out
    # frozen base + trained LoRA factors, merged for export
    from ode_lm.models.materialize import materialize

    merged, run = load_model(out)
    assert run.step == 4 and type(merged).__name__ == "ParallelLM"
    assert run.finetune["method"] == "lora"
    base = materialize(load_model(pretrained)[0], 2)
    w_new = np.asarray(merged.blocks.weights["qkv_kernel"][...])
    w_old = np.asarray(base.blocks.weights["qkv_kernel"][...])
    assert np.abs(w_new - w_old).max() > 0  # the LoRA update is merged in
    np.testing.assert_array_equal(np.asarray(merged.blocks.weights["out_kernel"][...]),
                                  np.asarray(base.blocks.weights["out_kernel"][...]))  # no LoRA
    res = export(out, "raw", str(tmp_path / "raw"), verify_logits=True)
    assert res.max_abs_diff == 0.0
    # the merged weights evaluate like the wrapped model the trainer evaluated at its end:
    # float32 losses ~5 (ulp 4.8e-7), W + (α/r)·A·B folded once instead of inside the step
    final = RunDir(out).finetune_result()["eval"]["eval/loss"]
    assert abs(load_run(out).evaluate().loss - final) < 1e-5


def test_full_continuous_finetune_at_new_depth(tmp_path, pretrained, corpus, capsys):
    out = str(tmp_path / "full4")
    gin = _gin(tmp_path, pretrained, corpus, out, M=4, METHOD="full", MODE="continuous",
               TRAIN_STEPS=2)
    assert ft.main([f"--gin_file={gin}"]) == 0
    assert "(100.00%)" in capsys.readouterr().out
    config = RunDir(out).model_config()
    assert config.architecture == "ode" and config.num_steps == 4


@pytest.mark.parametrize("flag,message,counted,status", [  # 2: a setting refused when built
    ("--gin.TrainConfig.log_every=0", "TrainConfig.log_every=0: must be >= 1", False, 2),
    ("--gin.StepConfig.microbatches=3", "not divisible by batch shards x", True, 2),
])
def test_a_finetune_that_fails_before_its_first_step_leaves_model_dir_as_found(
        tmp_path, pretrained, corpus, capsys, flag, message, counted, status):
    """An error found after the command line parsed (a bad gin value read when the configs
    are built; a setting the trainer refuses, after the pretrained run was checked and its
    parameters counted) leaves a new MODEL_DIR as it found it: absent stays absent, empty
    stays empty (no finetune.json)."""
    absent, empty = tmp_path / "absent", tmp_path / "empty"
    empty.mkdir()
    for out in (absent, empty):
        gin = _gin(tmp_path, pretrained, corpus, str(out))
        assert ft.main([f"--gin_file={gin}", flag]) == status
        captured = capsys.readouterr()
        assert ("fine-tuning" in captured.out) == counted  # as far as the parameter count
        assert message in captured.err
    assert not absent.exists()
    assert list(empty.iterdir()) == []


def test_bad_inputs(tmp_path, pretrained, corpus, capsys):
    def err(status=1, **over):  # 2: a setting FinetuneConfig refuses when built
        out = str(tmp_path / f"bad{len(os.listdir(tmp_path))}")
        gin = _gin(tmp_path, pretrained, corpus, out, **over)
        assert ft.main([f"--gin_file={gin}"]) == status
        text = capsys.readouterr().err.strip()
        assert "\n" not in text
        return text

    assert "FINETUNE_STEPS=0: must be a positive" in err(2, M=0)
    assert "FINETUNE_STEPS=-1" in err(2, M=-1)
    assert "METHOD='qlora'" in err(2, METHOD="qlora")
    assert "LoRA target(s) ['attention'] match no linear layer" in err(TARGETS="('attention',)")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    RunDir(str(empty)).write_model_config(tiny_config("gpt2", vocab_size=384))
    gin = _gin(tmp_path, str(empty), corpus, str(tmp_path / "x"))
    assert ft.main([f"--gin_file={gin}"]) == 1
    assert "no checkpoint under" in capsys.readouterr().err
    other = str(tmp_path / "bpe_data")
    msg = err(DATA_DIR=other, TOKENIZER="bpe:300")
    assert "tokenizer mismatch" in msg and "'bytes'" in msg and "'bpe:300'" in msg
