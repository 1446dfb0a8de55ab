"""Tokenizer files of a run's prepared data, copied next to an `hf` export.

``bpe:<n>`` and ``hf:<file>`` tokenizers are a ``tokenizer.json`` that transformers loads as
``PreTrainedTokenizerFast`` (pad token = EOS, left padding, so batched ``generate`` works);
sentencepiece models are copied as ``tokenizer.model``. Other tokenizers (tiktoken, bytes)
are recorded in ``ode_lm_tokenizer.json`` only.

``tokenizer_config.json`` names the stock class, so no tokenizer code ships. For an export
with custom model code (``auto_map`` in config.json) ``AutoTokenizer.from_pretrained`` still
needs an explicit ``trust_remote_code`` (``False`` is enough): transformers 5.25 reads
config.json through ``AutoConfig`` first, and that asks interactively when the flag is absent.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from ode_lm.data.manifest import MANIFEST, has_manifest, manifest_path

TOKENIZER_NOTE = "ode_lm_tokenizer.json"


def _manifest(data_dir: str) -> dict[str, Any] | None:
    """The data dir's manifest as written (read, not checked: export only takes the
    tokenizer's record from it); None when there is none."""
    if not has_manifest(data_dir):
        return None
    with open(manifest_path(data_dir)) as f:
        return json.load(f)


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids(data_dir: str | None) -> dict[str, int]:
    """bos/eos/pad ids for config.json: all the EOS (GPT-2 style documents are EOS-separated;
    padding is masked out, so any id will do). Empty without a tokenizer (a weights-only
    export): the ids are left out, not null (a stock class's config alone marks them null,
    ``convert.write_hf``, since it would otherwise fill in its own defaults)."""
    m = _manifest(data_dir) if data_dir else None
    eos = _eos_id(m)
    if eos is None:
        return {}
    return dict.fromkeys(TOKEN_ID_KEYS, eos)


def check_tokenizer_source(data_dir: str | None) -> None:
    """An export carries the run's tokenizer: refuse, in one line, when the data dir that
    holds it (the run's, or ``--data_dir``) is gone, unless a weights-only export was asked
    for. A run that records no data at all (built in code) exports its weights alone."""
    if data_dir is not None and _manifest(data_dir) is None:
        raise FileNotFoundError(
            f"the run's data dir {data_dir} is missing (no {MANIFEST}), so its tokenizer "
            "can't be exported: pass --data_dir=DIR, or --weights_only for weights alone")


def generation_config(ids: dict[str, int | None]) -> dict[str, object]:
    """generation_config.json: the token ids ``generate`` uses (greedy by default)."""
    return {**ids, "do_sample": False, "_from_model_config": False}


def _eos_id(m: dict[str, Any] | None) -> int | None:
    if not m:
        return None
    eos = m.get("eos_id", m.get("tokenizer", {}).get("eos_id"))
    return None if eos is None else int(eos)


def copy_tokenizer(data_dir: str | None, out_dir: str) -> list[str]:
    """Copy what transformers can load; returns the written file names (may be empty)."""
    m = _manifest(data_dir) if data_dir else None
    if m is None:
        return []
    tok = m.get("tokenizer", {})
    spec = str(tok.get("spec", ""))
    kind, _, arg = spec.partition(":")
    written: list[str] = []
    src = None
    if kind == "bpe":
        src = os.path.join(data_dir, tok.get("file") or "tokenizer.json")
    elif kind == "hf":
        src = arg
    if src and os.path.exists(src):
        shutil.copyfile(src, os.path.join(out_dir, "tokenizer.json"))
        eos = _eos_token(src, _eos_id(m))
        # Left padding: batched generate() appends after each row's last real token.
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
               "padding_side": "left"}
        if eos is not None:
            cfg.update(eos_token=eos, bos_token=eos, unk_token=eos, pad_token=eos)
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        written += ["tokenizer.json", "tokenizer_config.json"]
    elif kind == "sentencepiece" and os.path.exists(arg):
        shutil.copyfile(arg, os.path.join(out_dir, "tokenizer.model"))
        written.append("tokenizer.model")
    with open(os.path.join(out_dir, TOKENIZER_NOTE), "w") as f:
        json.dump({"spec": spec, "sha256": tok.get("sha256"), "eos_id": _eos_id(m),
                   "vocab_size": tok.get("vocab_size"), "data_dir": data_dir}, f, indent=2)
    return written + [TOKENIZER_NOTE]


def _eos_token(tokenizer_json: str, eos_id: int | None) -> str | None:
    if eos_id is None:
        return None
    with open(tokenizer_json) as f:
        data = json.load(f)
    for added in data.get("added_tokens", []):
        if added.get("id") == eos_id:
            return added.get("content")
    vocab = data.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict):
        for token, i in vocab.items():
            if i == eos_id:
                return token
    return None
