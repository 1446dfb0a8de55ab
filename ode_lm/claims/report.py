"""Run a set of claims over seeds, and write what they found: ``claims.json`` (every claim's
statement, statistic, threshold, per-seed values and evidence, verdict) and its markdown
table, the one the docs' claims page is generated from (``tools/doc_tables.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ode_lm.claims.suite import Claim, Context
from ode_lm.claims.verdict import judge


def evaluate(claims: Sequence[Claim], ctx: Context, seeds: Sequence[int],
             on_verdict: Callable[[dict], None] = lambda row: None) -> list[dict[str, Any]]:
    """Each claim measured on each seed (runs trained on first need, reused after), then
    judged. Claims go in order, seeds inside: a stopped suite has its finished runs kept."""
    rows = []
    for c in claims:
        values, evidence = [], []
        for seed in seeds:
            value, ev = c.measure(ctx, seed)
            values.append(value)
            evidence.append({"seed": seed, **ev})
        v = judge(values, c.threshold)
        row = {"id": c.id, "group": c.group, "paper": c.paper, "statistic": c.statistic,
               "threshold": dataclasses.asdict(c.threshold), "seeds": list(seeds),
               **dataclasses.asdict(v), "evidence": evidence}
        on_verdict(row)
        rows.append(row)
    return rows


def _num(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:+.2f}" if abs(x) < 100 else f"{x:+.0f}"


def threshold_text(t: dict) -> str:
    return f"{t['side']} {t['value']:g}{t.get('unit', '')}"


def verdict_line(row: dict) -> str:
    """One line per claim, as the command prints it."""
    vals = ", ".join(_num(v) for v in row["values"])
    return (f"{row['verdict'].upper():14s} {row['id']}: [{vals}] "
            f"(threshold {threshold_text(row['threshold'])})")


def format_table(data: dict) -> str:
    """The markdown table of a ``claims.json``: one row per claim, grouped."""
    lines = []
    group = None
    for row in data["claims"]:
        if row["group"] != group:
            group = row["group"]
            if lines:
                lines.append("")
            lines += [f"**{group}**", "",
                      "| claim | statistic | threshold | per seed | verdict |",
                      "| --- | --- | ---: | ---: | --- |"]
        vals = " / ".join(_num(v) for v in row["values"])
        lines.append(f"| `{row['id']}` | {row['statistic']} | "
                     f"{threshold_text(row['threshold'])} | {vals} | **{row['verdict']}** |")
    return "\n".join(lines)
