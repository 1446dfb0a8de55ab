"""Corpus statistics used as a yardstick for a trained model's loss.

The unigram entropy H = -sum_v p(v) ln p(v) of the training tokens is the loss (in nats) of
the best model that ignores context: a language model that learned anything beats it.
A mixture's token frequencies change with its weights, so it gets one figure per component,
the yardstick of that component's own ``eval/<component>/loss``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def unigram_entropy(data_config: Any, split: str = "train") -> float:
    """Entropy in nats of the token frequencies of a prepared split (exact, all tokens)."""
    from ode_lm.data.pipeline import open_split

    _, records = open_split(data_config, split)
    counts = np.zeros(0, np.int64)
    for start in range(0, len(records), 4096):
        docs = records.__getitems__(np.arange(start, min(start + 4096, len(records))))
        c = np.bincount(np.concatenate(docs).astype(np.int64))
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[: len(c)] += c
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_entropies(data_config: Any) -> dict[str, float]:
    """``data/unigram_entropy`` of a single source, or ``data/<component>/unigram_entropy``
    of each component of a mixture (each read from its own data dir and tokenizer)."""
    if getattr(data_config, "mixture", None):
        from ode_lm.data.config import mixture_components

        return {f"data/{name}/unigram_entropy": unigram_entropy(c)
                for name, c in mixture_components(data_config)}
    return {"data/unigram_entropy": unigram_entropy(data_config)}
