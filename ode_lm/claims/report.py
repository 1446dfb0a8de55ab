"""Run a set of claims over seeds, and write what they found: ``claims.json`` (every claim's
statement, statistic, threshold, per-seed values and evidence, verdict) and its markdown
table, the one the docs' claims page is generated from (``tools/doc_tables.py``).
"""

from __future__ import annotations

import dataclasses
import os
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


def evidence_lines(data: dict) -> list[str]:
    """Per claim: the paper's statement and every seed's evidence, as markdown."""
    lines = []
    for row in data["claims"]:
        lines += ["", f"### `{row['id']}`: {row['verdict']}", "", f"Paper: {row['paper']}.",
                  "", f"Statistic: {row['statistic']}; threshold "
                  f"{threshold_text(row['threshold'])}.", ""]
        keys = [k for k in row["evidence"][0] if k != "seed"] if row["evidence"] else []
        if keys:
            lines += ["| seed | " + " | ".join(keys) + " |",
                      "| ---: |" + " ---: |" * len(keys)]
            for ev in row["evidence"]:
                lines.append(f"| {ev['seed']} | " + " | ".join(_cell(ev.get(k)) for k in keys)
                             + " |")
    return lines


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "–" if x is None else str(x)


def write_page(data: dict, path: str, figures: list[str]) -> str:
    """The suite's report page: verdict table, figures, then each claim's evidence."""
    prov = data.get("provenance", {})
    head = [f"# Claims on {data['corpus']} ({data['scale']}, seeds {data['seeds']})", "",
            f"`{prov.get('command', 'ode-lm reproduce')}`; commit "
            f"{str(prov.get('commit'))[:10]}, {str(prov.get('date', ''))[:10]}.", "",
            format_table(data), ""]
    head += [f"![{os.path.basename(f)}]({os.path.basename(f)})" for f in figures]
    with open(path, "w") as f:
        f.write("\n".join(head + evidence_lines(data)) + "\n")
    return path
