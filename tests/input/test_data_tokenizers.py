"""Tokenizer backends, all on small local files (no downloads)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from ode_lm.data import get_tokenizer, padded_vocab_size
from ode_lm.data.corpus import builtin_documents
from ode_lm.data.tokenizers import train_bpe

TEXT = "A Neural ODE transformer solves dx/dt = f(x, t) with N steps. Ünïcode ✓"


def test_padded_vocab_size():
    assert [padded_vocab_size(n) for n in (1, 128, 129, 50257)] == [128, 128, 256, 50304]
    with pytest.raises(ValueError, match="positive"):
        padded_vocab_size(0)


def test_bytes_roundtrip():
    tok = get_tokenizer("bytes")
    ids = tok.encode(TEXT)
    assert tok.vocab_size == 257 and tok.eos_id == 256 and ids.max() < 256
    assert tok.decode(ids) == TEXT


def _tiny_tiktoken(path):
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"th", b"he", b"the", b"in", b" t", b" the"):
        ranks[merge] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    return path


def test_tiktoken_local_file(tmp_path):
    tok = get_tokenizer(f"tiktoken:{_tiny_tiktoken(tmp_path / 'tiny.tiktoken')}")
    assert tok.eos_id == 262 and tok.vocab_size == 263
    ids = tok.encode("the theme in the")
    assert 261 in ids.tolist()  # " the" merged
    assert tok.decode(ids) == "the theme in the"
    assert len(tok.fingerprint) == 64


def test_tiktoken_named_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache, no network
    try:
        tok = get_tokenizer("tiktoken:gpt2")
    except RuntimeError as e:
        assert "TIKTOKEN_CACHE_DIR" in str(e) and "tiktoken:gpt2" in str(e)
    else:  # a machine with network access: it must then be GPT-2 itself
        assert (tok.vocab_size, tok.eos_id) == (50257, 50256)


def test_hf_and_bpe(tmp_path):
    texts = list(builtin_documents()[:300])
    path = train_bpe(texts, 400, tmp_path / "tokenizer.json")
    for spec in (f"hf:{path}", "bpe:400"):
        tok = get_tokenizer(spec, tmp_path)
        assert tok.eos_id == 0 and tok.vocab_size == 400
        assert tok.decode(tok.encode(TEXT)) == TEXT
    a, b = get_tokenizer(f"hf:{path}").encode_batch(texts[:3]), [
        get_tokenizer(f"hf:{path}").encode(t) for t in texts[:3]]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    fast = get_tokenizer("bpe:400", tmp_path)
    assert fast._enc is not None, "bpe:<n> encodes through tiktoken"
    hf_ids = get_tokenizer(f"hf:{path}").encode_batch(texts[:200])
    assert all(np.array_equal(x, y) for x, y in zip(fast.encode_batch(texts[:200]), hf_ids,
                                                     strict=True))
    with pytest.raises(FileNotFoundError, match="trained by ode-lm prepare"):
        get_tokenizer("bpe:400", tmp_path / "elsewhere")


def test_sentencepiece(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(builtin_documents()[:400]))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=300, minloglevel=2)
    tok = get_tokenizer(f"sentencepiece:{tmp_path / 'sp.model'}")
    assert tok.vocab_size == 300 and tok.eos_id == 2
    assert tok.decode(tok.encode("the solver steps")) == "the solver steps"


@pytest.mark.parametrize("spec, match", [
    ("wordpiece:x", "unknown tokenizer spec 'wordpiece:x'"),
    ("bpe:abc", "expected 'bpe:<vocab size>'"),
    ("hf:/nonexistent/tokenizer.json", "does not exist"),
    ("", "non-empty"),
])
def test_bad_specs(spec, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        get_tokenizer(spec, "/tmp")


def test_tiktoken_gpt2_offline_from_a_ranks_file(tmp_path, monkeypatch):
    """The documented way: TIKTOKEN_GPT2_FILE, else TIKTOKEN_CACHE_DIR/gpt2.tiktoken."""
    from data_helpers import small_texts, write_jsonl

    from ode_lm.data import DataConfig, ensure_prepared

    ranks = _tiny_tiktoken(tmp_path / "gpt2.tiktoken")
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_GPT2_FILE", str(ranks))
    tok = get_tokenizer("tiktoken:gpt2")
    # GPT-2's ids: <|endoftext|> = 50256 whatever the file, tiktoken's own GPT-2 regex
    assert (tok.vocab_size, tok.eos_id, tok.file) == (50257, 50256, str(ranks))
    ids = tok.encode("the theme in the ✓")
    assert 261 in ids.tolist() and tok.decode(ids) == "the theme in the ✓"
    monkeypatch.delenv("TIKTOKEN_GPT2_FILE")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    from_cache = get_tokenizer("tiktoken:gpt2")
    assert from_cache.fingerprint == tok.fingerprint
    assert from_cache.encode("the theme").tolist() == tok.encode("the theme").tolist()
    src = write_jsonl(tmp_path / "raw.jsonl", small_texts(30))
    cfg = DataConfig(data_dir=str(tmp_path / "p"), source=str(src), tokenizer="tiktoken:gpt2",
                     holdout_fraction=0.2)
    m = ensure_prepared(cfg)
    assert (m["vocab_size"], m["eos_id"], m["tokenizer"]["sha256"]) == (50257, 50256,
                                                                       tok.fingerprint)


@pytest.mark.parametrize("content, match", [
    (None, r"TIKTOKEN_GPT2_FILE=\S+missing\.tiktoken does not exist"),
    ("dGhl 0\nnot-base64!! 1\n", r"TIKTOKEN_GPT2_FILE=\S+: \S+bad\.tiktoken:2 is not "
                                 r"'<base64 token> <rank>'"),
    ("dGhl 0\n", r"TIKTOKEN_GPT2_FILE=\S+: \S+bad\.tiktoken lacks 256 of the 256 single-byte"),
    ("big", r"has ranks up to 50300, but GPT-2's are 0\.\.50255"),
])
def test_tiktoken_gpt2_file_errors_name_the_env_var_and_path(tmp_path, monkeypatch, content,
                                                             match):
    path = tmp_path / ("missing.tiktoken" if content is None else "bad.tiktoken")
    if content == "big":
        _tiny_tiktoken(path)
        path.write_text(path.read_text() + f"{base64.b64encode(b'zz').decode()} 50300\n")
    elif content is not None:
        path.write_text(content)
    monkeypatch.setenv("TIKTOKEN_GPT2_FILE", str(path))
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        get_tokenizer("tiktoken:gpt2")
    assert "\n" not in str(e.value)


def test_tiktoken_file_is_reread_after_an_edit(tmp_path, monkeypatch):
    """tiktoken's own loader caches local files by path: an edited file must not go stale."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_tiktoken(tmp_path / "tiny.tiktoken")
    before = get_tokenizer(f"tiktoken:{path}")
    path.write_text(path.read_text() + f"{base64.b64encode(b'in the').decode()} 262\n")
    after = get_tokenizer(f"tiktoken:{path}")
    assert (before.vocab_size, after.vocab_size) == (263, 264)
    assert after.fingerprint != before.fingerprint
    assert not (tmp_path / "cache").exists()  # nothing written into the cache
