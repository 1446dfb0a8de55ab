"""hf exports the ecosystem loads as they are: stock classes for the sequential baselines, a
KV cache in the shipped ODE model, a tokenizer with a pad token, world-readable files."""

from __future__ import annotations

import builtins
import json
import os

import numpy as np
import pytest
from export_helpers import logits, make_run, tiny_config

from ode_lm.export import export
from ode_lm.training.saved_run import load_model

pytest.importorskip("torch", reason="pip install -e '.[hf]' for the hf round trips")
pytest.importorskip("transformers", reason="pip install -e '.[hf]' for the hf round trips")

import torch  # noqa: E402
import transformers  # noqa: E402

EOS = 0  # train_bpe's <|endoftext|>


def _tokens(vocab=64, n=12):
    return np.random.default_rng(0).integers(0, vocab, size=(2, n))


def _bpe_data(path) -> str:
    """A prepared-data dir with only what export reads: manifest.json + tokenizer.json."""
    from ode_lm.data.tokenizers import get_tokenizer, train_bpe

    path.mkdir()
    train_bpe([f"the solver takes step {i} of the ODE at time {i / 7:.3f}" for i in range(300)],
              300, path / "tokenizer.json")
    tok = get_tokenizer("bpe:300", str(path))
    assert tok.eos_id == EOS
    (path / "manifest.json").write_text(json.dumps({"tokenizer": {
        "spec": "bpe:300", "file": "tokenizer.json", "sha256": tok.fingerprint,
        "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}}))
    return str(path)


@pytest.mark.parametrize("flavour,cls,model_type", [
    ("gpt2", "GPT2LMHeadModel", "gpt2"),
    ("llama", "LlamaForCausalLM", "llama"),
    ("neox", "GPTNeoXForCausalLM", "gpt_neox"),
])
def test_sequential_baseline_exports_to_the_stock_class(tmp_path, flavour, cls, model_type):
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    # Non-default eps / theta / MLP width: a config key mapped wrongly moves the logits.
    make_run(run, tiny_config(flavour, architecture="sequential", num_layers=3, mlp_dim=48,
                              norm_eps=1e-2, rope_theta=500.0))
    res = export(run, "hf", out, verify_logits=True)
    assert res.max_abs_diff < 1e-4
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert "auto_map" not in cfg and cfg["model_type"] == model_type
    assert cfg["architectures"] == [cls]
    assert not any(n.endswith(".py") for n in os.listdir(out))  # no custom code shipped
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == cls and hf.config.num_hidden_layers == 3
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ref, _ = load_model(run)
    with torch.no_grad():
        got = hf(input_ids=torch.as_tensor(_tokens())).logits.numpy()
    np.testing.assert_allclose(got, logits(ref, _tokens()), atol=1e-4, rtol=0)
    # Uninformed defaults (GPT-2's 50256, Llama's eos 2) must not stand in for our ids.
    assert hf.config.eos_token_id is None and hf.generation_config.eos_token_id is None


def _count_fed_tokens(model) -> list[int]:
    """Records how many tokens each forward embeds: the prefix must not be recomputed."""
    fed: list[int] = []
    model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: fed.append(int(args[0].shape[1])))
    return fed


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_shipped_ode_model_caches_keys_and_values(tmp_path, flavour):
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    make_run(run, tiny_config(flavour, num_steps=3, init_std=0.5))
    export(run, "hf", out, num_steps=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    prompt = torch.as_tensor(_tokens()[:, :5])
    with torch.no_grad():  # prefill + one cached step == the full forward, position by position
        full = hf(input_ids=torch.as_tensor(_tokens()[:, :7]), use_cache=False).logits
        pre = hf(input_ids=prompt, use_cache=True)
        assert pre.cache is not None and pre.cache.get_seq_length() == 5
        assert len(pre.cache.layers) == 3  # one cache layer per (Euler step × stage)
        step = hf(input_ids=torch.as_tensor(_tokens()[:, 5:7]), cache=pre.cache, use_cache=True)
    np.testing.assert_allclose(step.logits.numpy(), full[:, 5:7].numpy(), atol=1e-5, rtol=0)
    fed = _count_fed_tokens(hf)
    new = 8
    cached = hf.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=True)
    assert fed == [5] + [1] * (new - 1)  # prefill once, then one token per step
    fed.clear()
    uncached = hf.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=False)
    assert fed == list(range(5, 5 + new))  # the reference really recomputes
    assert cached.shape == (2, 5 + new)
    assert torch.equal(cached, uncached)


def _no_prompt(monkeypatch) -> list:
    """Records every interactive question (transformers wraps ``input()`` in ``except
    Exception``, so raising here would be swallowed): the caller asserts the list is empty."""
    asked: list = []
    monkeypatch.setattr(builtins, "input", lambda *a, **k: asked.append(a) or "n")
    return asked


def _no_custom_code(monkeypatch) -> None:
    """Any import of the export's own modules fails the test (trust_remote_code=False)."""
    def refuse(*a, **k):
        raise AssertionError("custom code was loaded")
    from transformers.models.auto import configuration_auto, tokenization_auto

    for mod in (configuration_auto, tokenization_auto):
        monkeypatch.setattr(mod, "get_class_from_dynamic_module", refuse)


@pytest.mark.parametrize("flavour,architecture", [("gpt2", "sequential"), ("llama", "ode")])
def test_tokenizer_pads_left_and_batched_generate_matches(tmp_path, monkeypatch, flavour,
                                                          architecture):
    data = _bpe_data(tmp_path / "data")
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    kw = {"num_layers": 2} if architecture == "sequential" else {"num_steps": 2}
    make_run(run, tiny_config(flavour, architecture=architecture, vocab_size=320, max_seq_len=64,
                              **kw))
    old = os.umask(0o022)
    try:
        export(run, "hf", out, data_dir=data)
    finally:
        os.umask(old)
    for name in os.listdir(out):  # readable by group and others like any other file
        assert os.stat(os.path.join(out, name)).st_mode & 0o044 == 0o044, name
    with open(os.path.join(out, "generation_config.json")) as f:
        gen = json.load(f)
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (EOS, EOS, EOS)
    asked = _no_prompt(monkeypatch)
    if architecture == "sequential":  # stock classes: no custom code, nothing to opt into
        tok = transformers.AutoTokenizer.from_pretrained(out)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    else:  # custom code (auto_map): AutoTokenizer reads config.json's AutoConfig entry first,
        # so the opt-in is explicit either way; False loads the stock tokenizer, runs no code
        with monkeypatch.context() as m:
            _no_custom_code(m)
            stock = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=False)
        tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        assert (stock.pad_token_id, stock.padding_side) == (EOS, "left")
        assert stock("the ODE at time")["input_ids"] == tok("the ODE at time")["input_ids"]
    assert asked == [], asked
    assert tok.pad_token_id == EOS and tok.padding_side == "left"
    assert hf.generation_config.pad_token_id == EOS
    texts = ["the solver takes step 12 of the ODE at time", "the ODE"]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # the short prompt is padded on the left
    new = 6
    rows = hf.generate(**batch, max_new_tokens=new, do_sample=False)[:, -new:]
    for text, row in zip(texts, rows, strict=True):
        alone = hf.generate(**tok([text], return_tensors="pt"), max_new_tokens=new,
                            do_sample=False)[0]
        alone = alone[len(tok(text)["input_ids"]):]
        assert row[: len(alone)].tolist() == alone.tolist()
        assert (row[len(alone):] == EOS).all()  # after an EOS the row is padding


def test_save_sharded_respects_the_umask(tmp_path):
    from ode_lm.export.safetensors_io import save_sharded

    tensors = {f"w{i}": np.full((64,), i, np.float32) for i in range(3)}
    old = os.umask(0o022)
    try:
        single = save_sharded(tensors, str(tmp_path / "one"))
        shards = save_sharded(tensors, str(tmp_path / "many"), max_shard_bytes=300)
        os.umask(0o077)
        private = save_sharded(tensors, str(tmp_path / "private"))
    finally:
        os.umask(old)
    assert len(shards) == 3
    for d, names in (("one", single), ("many", shards)):
        for n in names:
            assert os.stat(tmp_path / d / n).st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "private" / private[0]).st_mode & 0o777 == 0o600


def test_assisted_generation_with_the_same_run_as_its_own_draft(tmp_path):
    """The same run exported at a cheap N (the draft) and at its own N (the verifier):
    transformers' assisted generation gives the verifier's own greedy tokens."""
    run = str(tmp_path / "run")
    make_run(run, tiny_config("gpt2", num_steps=3, init_std=0.5))
    export(run, "hf", str(tmp_path / "draft"), num_steps=1)
    export(run, "hf", str(tmp_path / "verify"), num_steps=3)
    draft, verify = (transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / name, trust_remote_code=True).eval() for name in ("draft", "verify"))
    prompt = torch.as_tensor(_tokens()[:1, :5])  # assisted generation takes one row
    with torch.no_grad():
        alone = verify.generate(prompt, max_new_tokens=12, do_sample=False)
        assisted = verify.generate(prompt, max_new_tokens=12, do_sample=False,
                                   assistant_model=draft)
    assert torch.equal(assisted, alone)
