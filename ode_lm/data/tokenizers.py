"""Tokenizers behind one small interface, chosen by a spec string.

Specs: ``tiktoken:gpt2`` (the paper's tokenizer; offline from ``$TIKTOKEN_GPT2_FILE`` or
``$TIKTOKEN_CACHE_DIR/gpt2.tiktoken``, else tiktoken's own cache in ``TIKTOKEN_CACHE_DIR``) or
``tiktoken:<file.tiktoken>``, ``hf:<tokenizer.json>``, ``sentencepiece:<model>``,
``bpe:<vocab size>`` (a byte-level BPE trained on the corpus during preparation and saved
as ``tokenizer.json`` next to the prepared data) and ``bytes`` (UTF-8 bytes + EOS, for tests).

Every tokenizer exposes ``encode_batch``, ``decode``, ``vocab_size``, ``eos_id`` and a
``fingerprint`` (sha256 of what defines the token ids) that the manifest records, so
training refuses data tokenized with a different tokenizer.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from etils import epath

BPE_FILE = "tokenizer.json"
ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenisation regex (tiktoken's r50k pattern).
GPT2_PAT = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
_EOS_CANDIDATES = (ENDOFTEXT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eot_id|>")


def padded_vocab_size(n: int, multiple: int = 128) -> int:
    """Rounds the vocabulary up so the embedding/head shard evenly over 'tensor' devices.

    Ids in [n, padded) are never produced by the tokenizer; their logits only ever learn to
    be small, which leaves the loss over real tokens unchanged.
    """
    if n <= 0 or multiple <= 0:
        raise ValueError(f"padded_vocab_size needs positive sizes, got n={n}, multiple={multiple}")
    return -(-n // multiple) * multiple


def _sha256_file(path: str | os.PathLike) -> str:
    return hashlib.sha256(epath.Path(path).read_bytes()).hexdigest()


class Tokenizer:
    """Common interface; subclasses fill ``spec``, ``vocab_size``, ``eos_id``, ``fingerprint``."""

    spec: str
    vocab_size: int
    eos_id: int
    fingerprint: str
    file: str | None = None  # the file defining the ids, if any

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (int64 arrays) for each text, without EOS."""
        raise NotImplementedError

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size})"


class BytesTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus EOS = 256: no files, exact round trip."""

    def __init__(self) -> None:
        self.spec, self.vocab_size, self.eos_id, self.fingerprint = "bytes", 257, 256, "bytes-v1"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")


GPT2_FILE_ENV = "TIKTOKEN_GPT2_FILE"  # path of a gpt2.tiktoken ranks file (offline gpt2)
GPT2_RANKS_NAME = "gpt2.tiktoken"      # also looked for in $TIKTOKEN_CACHE_DIR
GPT2_EOT = 50256
log = logging.getLogger("ode_lm.data")


def load_ranks(path: str, what: str) -> dict[bytes, int]:
    """A ``.tiktoken`` ranks file (``<base64 token> <rank>`` per line), checked.

    Read directly rather than through ``tiktoken.load.load_tiktoken_bpe``: that caches a
    local file under the sha1 of its *path* in TIKTOKEN_CACHE_DIR, so an edited or replaced
    file at the same path would silently be read from the stale copy (and the cache dir must
    be writable). ``what`` names the file in errors (e.g. the env var it came from).
    """
    p = epath.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what}: file {path} does not exist")
    ranks: dict[bytes, int] = {}
    try:
        lines = p.read_bytes().splitlines()
    except OSError as e:
        raise OSError(f"{what}: cannot read {path} ({e.strerror or e})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{what}: {path}:{lineno} is not '<base64 token> <rank>' "
                             f"({line[:40]!r}); not a .tiktoken ranks file") from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{what}: {path} lacks {len(missing)} of the 256 single-byte tokens "
                         f"(e.g. byte {missing[0]}); not a byte-level BPE ranks file")
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{what}: {path} gives the same rank to two tokens")
    return ranks


def _gpt2_encoding(path: str, what: str):
    """GPT-2 from a ranks file, with tiktoken's own GPT-2 regex and ``<|endoftext|>`` = 50256."""
    import tiktoken
    from tiktoken_ext import openai_public

    ranks = load_ranks(path, what)
    top = max(ranks.values())
    if top >= GPT2_EOT:
        raise ValueError(f"{what}: {path} has ranks up to {top}, but GPT-2's are 0..{GPT2_EOT - 1} "
                         f"({GPT2_EOT} is <|endoftext|>): not the GPT-2 ranks file")
    if len(ranks) != GPT2_EOT:
        log.warning("%s: %s has %d ranks, GPT-2 has %d: not the GPT-2 tokenizer?", what, path,
                    len(ranks), GPT2_EOT)
    return tiktoken.Encoding(name="gpt2", pat_str=openai_public.r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={ENDOFTEXT: GPT2_EOT})


def gpt2_ranks_file() -> tuple[str, str] | None:
    """(path, how it was found) of a local GPT-2 ranks file: ``$TIKTOKEN_GPT2_FILE`` (which
    must then exist), else ``$TIKTOKEN_CACHE_DIR/gpt2.tiktoken``; None if neither."""
    env = os.environ.get(GPT2_FILE_ENV)
    if env:
        if not epath.Path(env).exists():
            raise FileNotFoundError(f"tokenizer 'tiktoken:gpt2': {GPT2_FILE_ENV}={env} does not "
                                    "exist (unset it or point it at a gpt2.tiktoken ranks file)")
        return env, f"tokenizer 'tiktoken:gpt2' ({GPT2_FILE_ENV}={env})"
    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    if cache and (epath.Path(cache) / GPT2_RANKS_NAME).exists():
        path = os.fspath(epath.Path(cache) / GPT2_RANKS_NAME)
        return path, f"tokenizer 'tiktoken:gpt2' (TIKTOKEN_CACHE_DIR={cache})"
    return None


class TiktokenTokenizer(Tokenizer):
    """tiktoken: a named encoding (offline through its cache) or a local ``.tiktoken`` file.

    ``tiktoken:gpt2`` offline: ``$TIKTOKEN_GPT2_FILE``, else ``$TIKTOKEN_CACHE_DIR/gpt2.tiktoken``,
    else tiktoken's own cache (``vocab.bpe`` / ``encoder.json`` under the sha1 of their URLs).
    """

    def __init__(self, spec: str, name_or_path: str, num_threads: int = 2) -> None:
        import tiktoken

        self.spec, self.num_threads = spec, num_threads
        local = gpt2_ranks_file() if name_or_path == "gpt2" else None
        if local is not None:
            self._enc = _gpt2_encoding(*local)
            self.file = local[0]
        elif name_or_path.endswith(".tiktoken") or os.sep in name_or_path:
            ranks = load_ranks(name_or_path, f"tokenizer {spec!r}")
            eot = max(ranks.values()) + 1
            self._enc = tiktoken.Encoding(
                name=epath.Path(name_or_path).stem, pat_str=GPT2_PAT, mergeable_ranks=ranks,
                special_tokens={ENDOFTEXT: eot},
            )
            self.file = os.fspath(name_or_path)
        else:
            try:
                self._enc = tiktoken.get_encoding(name_or_path)
            except Exception as e:  # noqa: BLE001 - network / cache errors vary by version
                hint = (f"set {GPT2_FILE_ENV}=/path/{GPT2_RANKS_NAME}, or put {GPT2_RANKS_NAME} "
                        "(or tiktoken's own cache files) in TIKTOKEN_CACHE_DIR"
                        if name_or_path == "gpt2" else "put its files in TIKTOKEN_CACHE_DIR")
                raise RuntimeError(
                    f"tokenizer {spec!r}: could not load tiktoken encoding {name_or_path!r} "
                    f"offline ({type(e).__name__}); {hint} "
                    f"(TIKTOKEN_CACHE_DIR is now {os.environ.get('TIKTOKEN_CACHE_DIR')!r}), "
                    "or use 'tiktoken:<path to .tiktoken>'"
                ) from None
        self.vocab_size = self._enc.n_vocab
        if ENDOFTEXT not in self._enc._special_tokens:  # noqa: SLF001
            raise ValueError(f"tokenizer {spec!r} has no {ENDOFTEXT} token to use as EOS")
        self.eos_id = self._enc._special_tokens[ENDOFTEXT]  # noqa: SLF001
        h = hashlib.sha256()
        for tok, rank in sorted(self._enc._mergeable_ranks.items(), key=lambda kv: kv[1]):  # noqa: SLF001
            h.update(rank.to_bytes(4, "little") + len(tok).to_bytes(2, "little") + tok)
        h.update(repr(sorted(self._enc._special_tokens.items())).encode())  # noqa: SLF001
        self.fingerprint = h.hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if len(texts) == 1:
            return [np.asarray(self._enc.encode_ordinary(texts[0]), np.int64)]
        out = self._enc.encode_ordinary_batch(list(texts), num_threads=self.num_threads)
        return [np.asarray(ids, np.int64) for ids in out]

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (also what ``bpe:<n>`` trains and saves)."""

    def __init__(self, spec: str, path: str) -> None:
        from tokenizers import Tokenizer as _HF

        p = epath.Path(path)
        if not p.exists():
            raise FileNotFoundError(f"tokenizer {spec!r}: file {path} does not exist")
        try:
            self._tok = _HF.from_str(p.read_text())
        except Exception as e:  # noqa: BLE001
            msg = f"tokenizer {spec!r}: {path} is not a valid tokenizer.json: {e}"
            raise ValueError(msg) from None
        self.spec, self.file, self.fingerprint = spec, os.fspath(path), _sha256_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise ValueError(f"tokenizer {spec!r}: none of {_EOS_CANDIDATES} in {path} "
                             "to use as EOS")
        self.eos_id = int(eos)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-unicode map used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TrainedBPETokenizer(HFTokenizer):
    """``bpe:<n>``: the saved tokenizer.json, encoded by tiktoken (same ids, ~4x faster).

    Our byte-level BPE uses GPT-2's regex and assigns ids in merge order, so its vocabulary is
    a valid tiktoken rank table; a sample is checked against the HF encoder at load time, and
    the HF encoder is used if they ever disagree.
    """

    def __init__(self, spec: str, path: str, num_threads: int = 1) -> None:
        super().__init__(spec, path)
        self.num_threads, self._enc = num_threads, None
        try:
            import tiktoken

            u2b = _gpt2_unicode_to_byte()
            vocab = self._tok.get_vocab(with_added_tokens=False)
            ranks = {bytes(u2b[c] for c in t): i for t, i in vocab.items() if t != ENDOFTEXT}
            enc = tiktoken.Encoding(f"bpe{self.vocab_size}", pat_str=GPT2_PAT,
                                    mergeable_ranks=ranks, special_tokens={ENDOFTEXT: self.eos_id})
        except (KeyError, ValueError, ImportError):
            return
        sample = ["Hello world, the ODE solver's 12 steps:\n\tdx/dt = f(x, t)  ✓ Ünï"]
        if enc.encode_ordinary(sample[0]) == super().encode_batch(sample)[0].tolist():
            self._enc = enc

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self._enc is None:
            return super().encode_batch(texts)
        if self.num_threads > 1 and len(texts) > 1:
            out = self._enc.encode_ordinary_batch(list(texts), num_threads=self.num_threads)
        else:
            out = [self._enc.encode_ordinary(t) for t in texts]
        return [np.asarray(ids, np.int64) for ids in out]


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model`` file; its own ``</s>`` is the EOS."""

    def __init__(self, spec: str, path: str, num_threads: int = 2) -> None:
        import sentencepiece as spm

        p = epath.Path(path)
        if not p.exists():
            raise FileNotFoundError(f"tokenizer {spec!r}: file {path} does not exist")
        self._sp = spm.SentencePieceProcessor(model_proto=p.read_bytes())
        self.spec, self.file, self.fingerprint = spec, os.fspath(path), _sha256_file(path)
        self.vocab_size, self.eos_id = self._sp.get_piece_size(), self._sp.eos_id()
        self.num_threads = num_threads
        if self.eos_id < 0:
            raise ValueError(f"tokenizer {spec!r}: {path} defines no EOS piece (eos_id=-1)")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self._sp.encode(list(texts), num_threads=self.num_threads)
        return [np.asarray(ids, np.int64) for ids in out]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def bpe_vocab_size(spec: str) -> int:
    """The size in ``bpe:<n>``; a clear error for anything else."""
    try:
        n = int(spec.split(":", 1)[1])
    except (IndexError, ValueError):
        msg = f"tokenizer spec {spec!r}: expected 'bpe:<vocab size>', e.g. bpe:8192"
        raise ValueError(msg) from None
    if not 257 <= n <= 1 << 20:
        raise ValueError(f"tokenizer spec {spec!r}: bpe vocab size must be in [257, 2^20], got {n}")
    return n


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike) -> str:
    """Trains a byte-level BPE (GPT-2 style; EOS <|endoftext|> = id 0), saves tokenizer.json."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[ENDOFTEXT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = epath.Path(path)
    tmp = out.parent / (out.name + ".tmp")
    tmp.write_text(tok.to_str())
    tmp.replace(out)
    return os.fspath(out)


def get_tokenizer(spec: str, data_dir: str | os.PathLike | None = None, *,
                  num_threads: int = 2) -> Tokenizer:
    """Builds the tokenizer named by ``spec``; ``bpe:<n>`` loads ``<data_dir>/tokenizer.json``."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tokenizer spec must be a non-empty string, got {spec!r}")
    kind, _, arg = spec.partition(":")
    if kind == "bytes" and not arg:
        return BytesTokenizer()
    if kind == "tiktoken" and arg:
        return TiktokenTokenizer(spec, arg, num_threads=num_threads)
    if kind == "hf" and arg:
        return HFTokenizer(spec, arg)
    if kind == "sentencepiece" and arg:
        return SentencePieceTokenizer(spec, arg, num_threads=num_threads)
    if kind == "bpe":
        bpe_vocab_size(spec)
        if data_dir is None:
            raise ValueError(f"tokenizer {spec!r} is trained with the data: pass the data dir")
        path = epath.Path(data_dir) / BPE_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer {spec!r}: {path} not found; it is trained by ode-lm prepare"
            )
        return TrainedBPETokenizer(spec, os.fspath(path), num_threads=num_threads)
    raise ValueError(
        f"unknown tokenizer spec {spec!r}; use tiktoken:gpt2, tiktoken:<file>, "
        "hf:<tokenizer.json>, sentencepiece:<model>, bpe:<vocab size> or bytes"
    )


def describe(tok: Tokenizer) -> dict[str, Any]:
    """The manifest's record of a tokenizer."""
    file = epath.Path(tok.file).name if tok.spec.startswith("bpe:") and tok.file else tok.file
    return {"spec": tok.spec, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "sha256": tok.fingerprint, "file": file}
