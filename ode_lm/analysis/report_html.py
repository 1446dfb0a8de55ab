"""A self-contained HTML page: the input text coloured by each token's Lyapunov score."""

from __future__ import annotations

import html
import pathlib
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
import numpy as np  # noqa: E402

CMAP = "YlOrRd"


def _hex(cmap, value: float) -> str:
    return mcolors.to_hex(cmap(float(np.clip(value, 0.0, 1.0))))


def _text_color(rgb_hex: str) -> str:
    r, g, b = mcolors.to_rgb(rgb_hex)
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "#fff"


def lyapunov_html(
    token_text: Sequence[str],
    scores: np.ndarray,
    path,
    *,
    position: int,
    title: str = "Lyapunov sensitivity of the next-token prediction",
    score_name: str = "max exponent",
    extra: np.ndarray | None = None,
    extra_name: str = "sum of exponents",
) -> pathlib.Path:
    """Write the page: tokens as spans coloured by score, hover shows values.

    The token at ``position`` (the prediction being explained) is outlined. Its own block
    (I + dt·J_jj) usually dominates every other token, so the colour range (the legend) is
    set by the other tokens and the output token is shown saturated.
    """
    scores = np.asarray(scores, np.float64)
    if len(token_text) != len(scores):
        raise ValueError(f"lyapunov_html: {len(token_text)} tokens but {len(scores)} scores")
    cmap = matplotlib.colormaps[CMAP]
    others = np.delete(scores, position) if len(scores) > 1 else scores
    lo, hi = float(others.min()), float(others.max())
    span = hi - lo if hi > lo else 1.0
    spans = []
    for i, (tok, s) in enumerate(zip(token_text, scores, strict=False)):
        bg = _hex(cmap, (s - lo) / span)
        tip = f"#{i}  {score_name}={s:.4g}"
        if extra is not None:
            tip += f"  {extra_name}={float(extra[i]):.4g}"
        style = f"background:{bg};color:{_text_color(bg)}"
        if i == position:
            style += ";outline:2px solid #1f4fff"
        spans.append(
            f'<span class="tok" style="{style}" title="{html.escape(tip)}">'
            f"{html.escape(tok) or '&#8203;'}</span>"
        )
    stops = ", ".join(f"{_hex(cmap, v)} {int(v * 100)}%" for v in np.linspace(0, 1, 11))
    ticks = "".join(f"<span>{lo + v * span:.3g}</span>" for v in np.linspace(0, 1, 5))
    order = np.argsort(-scores, kind="stable")[:10]
    top_rows = "".join(
        f"<tr><td>{int(i)}</td><td><code>{html.escape(repr(token_text[i]))}</code></td>"
        f"<td>{scores[i]:.4g}</td></tr>" for i in order
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; line-height: 1.9; }}
.text {{ font-family: monospace; white-space: pre-wrap; border: 1px solid #ccc; padding: 1em; }}
.tok {{ border-radius: 3px; padding: 1px 0; }}
.bar {{ height: 14px; width: 30em; background: linear-gradient(to right, {stops}); }}
.ticks {{ display: flex; justify-content: space-between; width: 30em; font-size: 0.8em; }}
table {{ border-collapse: collapse; }} td {{ padding: 0 0.8em; }}
</style></head><body>
<h2>{html.escape(title)}</h2>
<p>Each input token is coloured by its <b>{html.escape(score_name)}</b>: how strongly a
perturbation of that token's hidden state is stretched by the dynamics of the prediction at
position <b>{position}</b> (outlined in blue). Tokens after that position cannot influence it
(causal attention) and score exactly 0. The colour range is set by the other tokens; the
outlined token itself, whose own state feeds the prediction directly, scores
{scores[position]:.4g} and is shown saturated. Hover over a token for its values.</p>
<div class="legend"><div>{html.escape(score_name)} (low → high)</div>
<div class="bar"></div><div class="ticks">{ticks}</div></div>
<div class="text">{''.join(spans)}</div>
<h3>Most sensitive tokens</h3>
<table><tr><th>position</th><th>token</th><th>{html.escape(score_name)}</th></tr>{top_rows}</table>
</body></html>
"""
    path = pathlib.Path(path)
    path.write_text(page, encoding="utf-8")
    return path
