"""ode-lm export (and its tools/convert_ckpt.py wrapper): raw round trip, hf round trip
through transformers, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from export_helpers import logits, make_run, tiny_config
from numerics import f32_atol

from ode_lm.export import export, load_raw
from ode_lm.export.safetensors_io import INDEX_NAME, load_sharded
from ode_lm.training.run_dir import RunDir
from ode_lm.training.saved_run import load_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tokens(n=12):
    return np.random.default_rng(0).integers(0, 61, size=(2, n))


def _hf_available() -> bool:
    return all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


needs_hf = pytest.mark.skipif(
    not _hf_available(),
    reason="torch/transformers not installed: pip install -e '.[hf]' for the hf round trip")


@pytest.mark.slow
def test_raw_round_trip_is_lossless_and_strips_optimizer(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, tiny_config("llama"))
    out = str(tmp_path / "raw")
    res = export(run, "raw", out, max_shard_bytes=30_000, verify_logits=True)
    assert res.max_abs_diff == 0.0
    assert os.path.exists(os.path.join(out, INDEX_NAME))  # sharded above the threshold
    names = set(load_sharded(out))
    assert "block/layers/qkv/w0" in names and not any("opt" in n or "mu" in n for n in names)
    model, config = load_raw(out)
    ref, _ = load_model(run)
    np.testing.assert_array_equal(logits(model, _tokens()), logits(ref, _tokens()))
    np.testing.assert_array_equal(logits(model, _tokens(), 7), logits(ref, _tokens(), 7))
    assert config == ref.config


def test_bf16_export_stores_bfloat16(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, tiny_config("gpt2"))
    out = str(tmp_path / "raw16")
    export(run, "raw", out, dtype="bf16")
    tensors = load_sharded(out)
    assert all(str(x.dtype) == "bfloat16" for x in tensors.values())


@needs_hf
@pytest.mark.parametrize("flavour", ["neox", "gpt2", "llama"])
def test_hf_round_trip_through_transformers(tmp_path, flavour):
    import torch
    import transformers

    run = str(tmp_path / "run")
    make_run(run, tiny_config(flavour, num_steps=3))
    out = str(tmp_path / "hf")
    shard = 40_000 if flavour == "llama" else 1 << 30
    res = export(run, "hf", out, num_steps=4, verify_logits=True, max_shard_bytes=shard)
    assert res.max_abs_diff < 1e-4
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["num_hidden_layers"] == 4
    if flavour == "neox":  # the native class, no custom code shipped
        assert cfg["architectures"] == ["GPTNeoXForCausalLM"]
        assert not any(n.endswith(".py") for n in os.listdir(out))
        hf = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert type(hf).__name__ == "GPTNeoXForCausalLM"
    else:
        assert os.path.exists(os.path.join(out, "modeling_ode_lm.py"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    if flavour == "llama":
        assert os.path.exists(os.path.join(out, INDEX_NAME))
    # Independent of --verify: the 4-step ODE's logits, compared here directly.
    ref, _ = load_model(run)
    with torch.no_grad():
        got = hf(input_ids=torch.as_tensor(_tokens())).logits.numpy()
    want = logits(ref, _tokens(), 4)
    # torch and XLA sum each dot (up to hidden_dim terms) in their own order, at each of the
    # 4 steps: the γ_n bound, 4·hidden_dim ulps of the largest logit
    np.testing.assert_allclose(got, want, rtol=0, atol=f32_atol(want, 4 * ref.config.hidden_dim))


def _cli(argv):
    from ode_lm.commands.export import main

    return main(argv)


@pytest.mark.parametrize("script", [["-m", "ode_lm", "export"], ["tools/convert_ckpt.py"]],
                         ids=["ode-lm export", "tools/convert_ckpt.py"])
def test_the_export_entries_share_one_cli(tmp_path, script):
    """``ode-lm export`` and the kept ``tools/convert_ckpt.py`` wrapper: same flags, same
    one-line errors (2: the command line, 1: the run), under their own names."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    prog = "ode-lm export" if script[0] == "-m" else "convert_ckpt.py"

    def run(*argv):
        return subprocess.run([sys.executable, *script, *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)

    usage = run("--model_dir=x", "--format=raw")  # --out missing
    assert usage.returncode == 2 and usage.stderr.startswith(f"{prog}: error: "), usage.stderr
    assert "--out" in usage.stderr and len(usage.stderr.strip().splitlines()) == 1
    failed = run(f"--model_dir={tmp_path / 'nope'}", "--format=raw", f"--out={tmp_path / 'x'}")
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.strip() == (f"{prog}: error: --model_dir={tmp_path / 'nope'}: "
                                     "no such directory"), failed.stderr


# exit 2: a flag's value is bad in itself; 1: it does not fit the run
@pytest.mark.parametrize("flavour,extra,message,status", [
    ("neox", ["--format=hf", "--num_steps=0"], "--num_steps=0: must be a positive", 2),
    ("neox", ["--format=hf", "--num_steps=-3"], "--num_steps=-3: must be a positive", 2),
    ("neox", ["--format=onnx"], "--format='onnx': unknown format", 2),
    ("gpt2", ["--format=hf-neox"], "a gpt2 model can't be mapped to GPTNeoXForCausalLM", 1),
    ("llama", ["--format=hf", "--dtype=fp16"], "--dtype='fp16'", 2),
    ("neox", ["--format=raw", "--num_steps=4"], "--num_steps=4 with --format=raw: a raw "
     "export keeps the continuous model", 2),
    ("neox", ["--format=raw", "--max_shard_mb=0"], "--max_shard_mb=0: must be > 0", 2),
    ("neox", ["--format=raw", "--max_shard_mb=-1"], "--max_shard_mb=-1: must be > 0", 2),
])
def test_cli_bad_input_one_line(tmp_path, capsys, flavour, extra, message, status):
    run = str(tmp_path / "run")
    make_run(run, tiny_config(flavour))
    rc = _cli([f"--model_dir={run}", f"--out={tmp_path / 'x'}", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == status and message in err and "\n" not in err
    assert not os.path.exists(tmp_path / "x")  # refused before writing anything


def test_verify_without_the_hf_extra_stops_before_writing(tmp_path, capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        None if name == "transformers" else real_find_spec(name, *a)))
    run = str(tmp_path / "run")
    make_run(run, tiny_config("gpt2"))
    rc = _cli([f"--model_dir={run}", f"--out={tmp_path / 'x'}", "--format=hf", "--num_steps=2",
               "--verify"])
    err = capsys.readouterr().err.strip()
    # the message names what is missing: transformers here, torch too on the lean install
    assert rc == 1 and "needs " in err and "transformers" in err and "[hf]" in err
    assert "\n" not in err
    assert not os.path.exists(tmp_path / "x")  # checked before the export is written


def test_sequential_baseline_hf_refusals_one_line(tmp_path, capsys):
    """Sequential baselines export to stock classes (tests/export/test_export_hf.py); what those
    classes cannot express is refused before anything is written."""
    run = str(tmp_path / "run")  # head_dim 9: ode-lm rotates 8 channels, Llama all 9
    make_run(run, tiny_config("llama", architecture="sequential", num_layers=2, d_model=36,
                              num_heads=4))
    for extra, message in ((["--format=hf"], "LlamaForCausalLM rotates all of them"),
                           (["--format=hf", "--num_steps=4"], "--num_steps=4: a sequential")):
        assert _cli([f"--model_dir={run}", f"--out={tmp_path / 'x'}", *extra]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
        assert not os.path.exists(tmp_path / "x")


def test_missing_run_and_missing_checkpoint(tmp_path, capsys):
    assert _cli([f"--model_dir={tmp_path / 'nope'}", "--format=raw",
                 f"--out={tmp_path / 'x'}"]) == 1
    assert "no such directory" in capsys.readouterr().err
    run = tmp_path / "empty"
    run.mkdir()
    RunDir(str(run)).write_model_config(tiny_config("gpt2"))
    assert _cli([f"--model_dir={run}", "--format=raw", f"--out={tmp_path / 'y'}"]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


def test_tokenizer_files_copied_from_prepared_data(tmp_path):
    from ode_lm.data.tokenizers import get_tokenizer, train_bpe
    from ode_lm.export.tokenizer_files import copy_tokenizer, token_ids

    data = tmp_path / "data"
    data.mkdir()
    train_bpe([f"the solver takes step {i} of the ODE" for i in range(200)], 300,
              data / "tokenizer.json")
    ours = get_tokenizer("bpe:300", str(data))
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {
        "spec": "bpe:300", "file": "tokenizer.json", "sha256": ours.fingerprint,
        "vocab_size": ours.vocab_size, "eos_id": ours.eos_id}}))
    out = tmp_path / "out"
    out.mkdir()
    assert "tokenizer.json" in copy_tokenizer(str(data), str(out))
    assert token_ids(str(data)) == {"bos_token_id": ours.eos_id, "eos_token_id": ours.eos_id,
                                    "pad_token_id": ours.eos_id}
    if _hf_available():
        import transformers

        hf = transformers.AutoTokenizer.from_pretrained(str(out))
        text = "the solver takes step 7"
        assert hf(text)["input_ids"] == [int(i) for i in ours.encode(text)]
        assert hf.eos_token_id == ours.eos_id


def test_overwrite_replaces_an_export_and_refuses_without_it(tmp_path, capsys):
    """A rerun of an export needs --overwrite; with it the new export is swapped in whole,
    nothing of the old one left and no staging directory beside it."""
    run = str(tmp_path / "run")
    make_run(run, tiny_config("llama"))
    out = tmp_path / "raw"
    argv = [f"--model_dir={run}", "--format=raw", f"--out={out}", "--weights_only"]
    assert _cli(argv) == 0
    (out / "stale.txt").write_text("from an older export")
    capsys.readouterr()
    assert _cli(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith("directory exists and is not empty (--overwrite replaces it)"), err
    assert (out / "stale.txt").exists()
    assert _cli([*argv, "--overwrite"]) == 0
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "run"]


def test_a_failed_verify_leaves_the_old_export_and_writes_none(tmp_path):
    """``--verify`` runs on the staged export, before the swap: a check that fails leaves
    an old export whole (``--overwrite``) and writes nothing at a new ``--out``; one line,
    exit 1. The check is made to fail by a tolerance of 0 (a sitecustomize in the
    installed script's process)."""
    import shutil

    from data_helpers import tree_hash

    script = shutil.which("ode-lm")
    if script is None:
        pytest.skip("the ode-lm console script is not on PATH (pip install -e .)")
    run = str(tmp_path / "run")
    make_run(run, tiny_config("llama"))
    old = tmp_path / "old"
    assert _cli([f"--model_dir={run}", "--format=raw", f"--out={old}", "--weights_only"]) == 0
    before = tree_hash(old)
    strict = tmp_path / "strict"
    strict.mkdir()
    (strict / "sitecustomize.py").write_text(
        "from ode_lm.export import verify\nverify.TOLERANCE['fp32'] = 0.0\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(strict), REPO]))
    env.pop("ODE_LM_DEBUG", None)
    for out, extra in ((old, ["--overwrite"]), (tmp_path / "new", [])):
        r = subprocess.run([script, "export", f"--model_dir={run}", "--format=raw",
                            f"--out={out}", "--weights_only", "--verify", *extra], env=env,
                           capture_output=True, text=True, timeout=300)
        err = r.stderr.strip()
        assert r.returncode == 1, (r.stdout, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"ode-lm export: error: --verify: {out}: max |\u0394 logits|"), err
        assert "--out left as it was" in err, err
    assert tree_hash(old) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "run", "strict"]
