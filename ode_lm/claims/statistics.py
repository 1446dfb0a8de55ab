"""The statistics the claims read from a trained model: spectra against depth, and the
Lyapunov token scores against what occluding each token does to the prediction.

Each function takes a run directory and returns plain floats (JSON), so the suite's records
cache them; the verdict logic never sees a model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NUM_TIMES = 101  # t points of an ODE's spectra (the same grid as ``ode-lm analyze spectral``)
NEAR_OUTPUT = 0.9  # "near t = 1": the depths t >= 0.9 (a baseline: its last layer)
LYAPUNOV_TEXTS = 6  # validation sequences scored per model
LYAPUNOV_TOKENS = 24  # their first tokens; the prediction read at the last one


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (ties get their mean rank); NaN for a constant input."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(np.corrcoef(_ranks(x), _ranks(y))[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(v.size, np.float64)
    ranks[order] = np.arange(v.size, dtype=np.float64)
    for value in np.unique(v):  # mean rank of ties
        tied = v == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def spectra_stats(model_dir: str) -> dict[str, Any]:
    """QK magnitude against depth (median |λ| per depth point: its rank correlation with
    depth and its last/first ratio) and the OV fraction of Re λ > 0 near the output."""
    from ode_lm.analysis.model_access import is_ode, model_spectra
    from ode_lm.training.saved_run import load_model

    model, _ = load_model(model_dir)
    ts = np.linspace(0.0, 1.0, NUM_TIMES) if is_ode(model) else None
    spec = model_spectra(model, ts=ts)
    depth = spec.normalized_depth
    qk_median = spec.magnitude_quantiles("qk", [0.5])[0]
    ov_positive = spec.positive_real_fraction("ov")
    near = depth >= NEAR_OUTPUT if is_ode(model) else depth == depth.max()
    return {"depth": depth.tolist(), "qk_median_abs": qk_median.tolist(),
            "ov_positive_real": ov_positive.tolist(),
            "qk_rank_correlation": spearman(depth, qk_median),
            "qk_last_first_ratio": float(qk_median[-1] / qk_median[0]),
            "ov_positive_real_near_output": float(ov_positive[near].mean())}


def validation_sequences(model_dir: str, count: int, length: int) -> np.ndarray:
    """The first ``count`` validation rows of the run's data with at least ``length`` real
    tokens, cut to ``length``: ``[count, length]``."""
    from ode_lm import data as data_lib
    from ode_lm.training.run_dir import RunDir

    rows = []
    for batch in data_lib.make_eval_iterator(RunDir(model_dir).data_config()):
        for tokens, mask in zip(batch["inputs"], batch["loss_mask"], strict=True):
            if mask[:length].all():
                rows.append(np.asarray(tokens[:length], np.int32))
            if len(rows) == count:
                return np.stack(rows)
    if not rows:
        raise ValueError(f"{model_dir}: no validation row has {length} tokens")
    return np.stack(rows)


def occlusion_effect(model, tokens: np.ndarray, replacement: int) -> np.ndarray:
    """KL(p ‖ p_i) of the prediction at the last position when token i is replaced by
    ``replacement``, for every earlier position i: ``[T - 1]``."""
    import jax
    import jax.numpy as jnp

    t = len(tokens)
    variants = np.repeat(tokens[None], t, axis=0)  # row 0: the text itself
    for i in range(t - 1):
        variants[i + 1, i] = replacement
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), variants.shape)
    logits = model(jnp.asarray(variants), positions, jnp.ones_like(positions))[:, -1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp[0])
    return np.asarray((p * (logp[0] - logp[1:])).sum(-1), np.float64)


def lyapunov_stats(model_dir: str) -> dict[str, Any]:
    """Per validation text: Spearman's ρ between each earlier token's Lyapunov score (its
    maximum exponent for the prediction at the last position) and the effect of occluding
    it; the same ρ for recency (the position itself) as a control. Medians over texts."""
    from ode_lm.analysis.model_access import model_lyapunov
    from ode_lm.training.saved_run import load_model

    model, _ = load_model(model_dir)
    texts = validation_sequences(model_dir, LYAPUNOV_TEXTS, LYAPUNOV_TOKENS)
    values, counts = np.unique(texts, return_counts=True)
    replacement = int(values[np.argmax(counts)])  # the texts' most frequent token
    rho, recency = [], []
    for tokens in texts:
        score = model_lyapunov(model, tokens, position=-1).max_exponent[:-1]
        effect = occlusion_effect(model, tokens, replacement)
        keep = tokens[:-1] != replacement  # occluding a token by itself changes nothing
        rho.append(spearman(score[keep], effect[keep]))
        recency.append(spearman(np.arange(len(effect))[keep], effect[keep]))
    return {"rho": rho, "recency_rho": recency, "replacement": replacement,
            "median_rho": float(np.nanmedian(rho)),
            "median_recency_rho": float(np.nanmedian(recency))}
