"""The claims report's figures, drawn from ``claims.json`` and the suite's run records alone
(no model is loaded): spectra against depth, and fine-tuning before / after at each M."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"ode-paper": "tab:red", "ode-default": "tab:blue", "sequential": "tab:gray",
           "parallel": "tab:olive"}


def spectra_figure(records: dict[str, Any], path: str) -> str | None:
    """QK median |λ| (relative to its value at the first depth) and the OV fraction of
    Re λ > 0 against normalised depth, one line per run and seed; None without spectra."""
    runs = [r for r in records.values() if "spectra" in r.get("stats", {})
            and r["name"] in COLOURS]
    if not runs:
        return None
    fig, (qk, ov) = plt.subplots(1, 2, figsize=(10, 3.8))
    seen = set()
    for r in sorted(runs, key=lambda r: (r["name"], r["seed"])):
        s = r["stats"]["spectra"]
        label = None if r["name"] in seen else r["name"]
        seen.add(r["name"])
        style = {"color": COLOURS[r["name"]], "label": label, "lw": 1.2,
                 "marker": "o" if len(s["depth"]) < 20 else None}
        first = s["qk_median_abs"][0]
        qk.plot(s["depth"], [v / first for v in s["qk_median_abs"]], **style)
        ov.plot(s["depth"], s["ov_positive_real"], **style)
    qk.set(xlabel="depth (t, or (layer+1)/L)", ylabel="median |λ(QK)| / its first value",
           title="QK magnitude against depth")
    ov.axhline(0.4, color="k", lw=0.6, ls="--")
    ov.set(xlabel="depth (t, or (layer+1)/L)", ylabel="fraction of Re λ(OV) > 0",
           title="OV: repulsive share (below the dashes: attractive)")
    qk.legend(fontsize=8)
    return _save(fig, path)


def finetune_figure(data: dict[str, Any], path: str) -> str | None:
    """Perplexity at each M relative to the pretrained model's own N: before fine-tuning,
    after (full, LoRA), and the default recipe with no fine-tuning; mean over seeds."""
    rows = [c for c in data["claims"] if c["id"].startswith("finetune-recovers-")]
    if not rows:
        return None
    groups: dict[int, dict[str, float]] = {}
    for c in rows:
        m, method = c["id"].removeprefix("finetune-recovers-m").split("-")
        ev = c["evidence"]
        own = [e["pretrained_own_n_ppl"] for e in ev]
        rel = {"before": [e["before_ppl"] / o - 1 for e, o in zip(ev, own, strict=True)],
               method: [e["finetuned_ppl"] / o - 1 for e, o in zip(ev, own, strict=True)],
               "default recipe, no fine-tuning": [e["default_recipe_at_m_ppl"] / o - 1
                                                  for e, o in zip(ev, own, strict=True)]}
        for k, v in rel.items():
            groups.setdefault(int(m), {})[k] = 100 * sum(v) / len(v)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    kinds = ["before", "full", "lora", "default recipe, no fine-tuning"]
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [j + i * width for j, _ in enumerate(sorted(groups))]
        ys = [groups[m].get(kind, float("nan")) for m in sorted(groups)]
        ax.bar(xs, ys, width, label=kind)
    ax.set_yscale("symlog", linthresh=10)
    ax.axhline(5, color="k", lw=0.6, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))],
                  [f"M={m}" for m in sorted(groups)])
    ax.set(ylabel="% above the pretrained N=6 perplexity",
           title="Fine-tuning at a new M (paper recipe, mean over seeds)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
