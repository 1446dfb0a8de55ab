"""``OdeLM``: an lm-eval ``LM`` over an ode-lm model at any N, scored like ``--model hf``.

Why it mirrors lm-eval's HF backend token for token: a score is only comparable with
published numbers (and with the same model exported to transformers) if the requests are
tokenised and truncated the same way. So, as ``HFLM`` does:

- context/continuation are split by ``TemplateLM._encode_pair`` (trailing context spaces move
  to the continuation; the whole string is encoded, the context's tokens cut off); an empty
  context is the prefix token (EOS: the export's BOS is its EOS) unless the continuation
  already starts with it;
- the scored window is ``(context + continuation)[-(max_length + 1):][:-1]``: truncated from
  the left to the model's ``max_seq_len``; the continuation's log-probabilities are summed and
  ``is_greedy`` is every continuation token being the argmax (over the whole padded vocab);
- documents for perplexity are cut into lm-eval's disjoint rolling windows after the prefix;
- generation left-truncates the prompt to ``max_length - max_gen_toks``, decodes greedily
  (``ode_lm.generation``, KV-cached) ``max_gen_toks`` tokens, stops at EOS and cuts the text at
  the first stop sequence.

Requests are batched (``batch_size`` rows, widths rounded up to a power of two from
``length_bucket``, so a task compiles a few programs, not one per width); padding is
segment 0 and never scored, so the batch a request lands in never changes its score.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from ode_lm import generation
from ode_lm.models.solve import Solve
from ode_lm.training.metrics import Progress

LoglikelihoodRequest = tuple[Any, list[int], list[int]]  # (cache key, context, continuation)


@functools.partial(jax.jit, static_argnames=("graphdef", "solve"))
def _score(graphdef, state, tokens, targets, segment_ids, *, solve):
    """(log p(target) [B, T], target == argmax [B, T]) for right-padded rows."""
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits = model(tokens, positions, segment_ids, solve=solve).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return target_logp, jnp.argmax(logits, axis=-1) == targets


def _bucket(n: int, smallest: int, cap: int) -> int:
    """The padded width for ``n`` tokens: a power of two >= ``smallest``, at most ``cap``."""
    width = smallest
    while width < n:
        width *= 2
    return max(n, min(width, cap))


class OdeLM(TemplateLM):
    """lm-eval's view of an ode-lm model: ``model`` (DiffEqFormer, a materialised or discrete
    baseline) with its ``tokenizer`` (``ode_lm.data.tokenizers``), solved at ``num_steps`` with
    ``solver`` (default: the model's)."""

    def __init__(self, model: nnx.Module, tokenizer: Any, *, num_steps: int | None = None,
                 solver: str | None = None, rtol: float | None = None,
                 atol: float | None = None, batch_size: int = 16,
                 max_length: int | None = None, max_gen_toks: int = 256,
                 length_bucket: int = 16, seed: int = 0) -> None:
        super().__init__()
        generation.check_num_steps(num_steps, "num_steps")
        if batch_size < 1:
            raise ValueError(f"lm-eval batch_size={batch_size}: must be >= 1")
        self.config = model.config
        self.graphdef, self.state = nnx.split(model)
        self._model = model
        self.tokenizer = tokenizer
        self.num_steps, self.solver, self.rtol, self.atol = num_steps, solver, rtol, atol
        self.batch_size = batch_size
        self._max_length = int(max_length or self.config.max_seq_len)
        self._max_gen_toks = max_gen_toks
        self.length_bucket = length_bucket
        self.seed = seed

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.spec)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """ode-lm tokenizers add no special tokens (documents are EOS-separated in training)."""
        return [int(i) for i in self.tokenizer.encode(string)]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in tokens])

    # ---------------------------------------------------------- log-likelihood
    def _loglikelihood_tokens(self, requests: list[LoglikelihoodRequest],
                              disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        windows = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("lm-eval request with an empty context or continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"lm-eval continuation of {len(continuation)} tokens exceeds "
                                 f"the model's max_seq_len={self.max_length}")
            window = (context + continuation)[-(self.max_length + 1):]
            windows.append((window, len(continuation)))
        # Longest first (as HFLM): rows of one batch have similar widths, so little padding.
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
        progress = Progress("lm-eval log-likelihood", len(order), unit="requests")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for i, res in zip(chunk, self._score_batch([windows[i] for i in chunk]),
                              strict=True):
                out[i] = res
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], res)
            progress.update(start + len(chunk))
        progress.done()
        return out

    def _score_batch(self, windows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        width = _bucket(max(len(w) - 1 for w, _ in windows), self.length_bucket, self.max_length)
        rows = self.batch_size
        tokens = np.zeros((rows, width), np.int32)
        targets = np.zeros((rows, width), np.int32)
        segments = np.zeros((rows, width), np.int32)
        for r, (w, _) in enumerate(windows):
            n = len(w) - 1
            tokens[r, :n], targets[r, :n], segments[r, :n] = w[:-1], w[1:], 1
        logp, greedy = _score(self.graphdef, self.state, jnp.asarray(tokens),
                              jnp.asarray(targets), jnp.asarray(segments),
                              solve=Solve.of(self.num_steps, self.solver, self.rtol,
                                             self.atol))
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        results = []
        for r, (w, cont_len) in enumerate(windows):
            n = len(w) - 1
            span = slice(n - cont_len, n)
            results.append((float(logp[r, span].sum(dtype=np.float32)),
                            bool(greedy[r, span].all())))
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Whole-document log-likelihoods in lm-eval's disjoint windows of ``max_length``."""
        windows, owner = [], []
        for idx, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(idx)
        totals = [0.0] * len(requests)
        for idx, (ll, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[idx] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -------------------------------------------------------------- generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with ``do_sample``, sampled) continuations cut at the stop sequences."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for indices in groups.values():
            gen_kwargs = copy.deepcopy(requests[indices[0]].args[1])
            texts = self._generate_group([requests[i].args[0] for i in indices], gen_kwargs)
            for i, text in zip(indices, texts, strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate_group(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None),
                                      eos=self.tok_decode([self.eot_token_id]))
        max_gen = int(kwargs.pop("max_gen_toks"))
        max_ctx = self.max_length - max_gen
        if max_ctx <= 0:
            raise ValueError(f"lm-eval max_gen_toks={max_gen} leaves no room for a prompt in "
                             f"the model's max_seq_len={self.max_length}")
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        top_p = float(kwargs.get("top_p") or 1.0)
        prompts = [self.tok_encode(c)[-max_ctx:] or [self.prefix_token_id] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts = [""] * len(prompts)
        progress = Progress("lm-eval generation", len(order), unit="requests")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            batch = [prompts[i] for i in chunk]
            width = _bucket(max(map(len, batch)), self.length_bucket, max_ctx)
            batch += [[self.prefix_token_id]] * (self.batch_size - len(batch))
            new = generation.generate(
                self._model, batch, max_new_tokens=max_gen, num_steps=self.num_steps,
                solver=self.solver, temperature=temperature, top_p=top_p, seed=self.seed,
                rtol=self.rtol, atol=self.atol, min_width=width)
            for i, row in zip(chunk, new, strict=False):
                row = row.tolist()
                if self.eot_token_id in row:
                    row = row[:row.index(self.eot_token_id)]
                texts[i] = postprocess_generated_text(self.tok_decode(row), until, None)
            progress.update(start + len(chunk))
        progress.done()
        return texts
