"""Reference pages say what ode-lm does now; what was tried, and when, is in docs/log.md.
A dated heading outside the log is a record that belongs in it, and a list kept in two
places drifts, so each is written once."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# 2026-12-05, 2026-12, "(2026": a date in a heading
DATE = re.compile(r"\b(?:19|20)\d\d-\d\d(?:-\d\d)?\b|\((?:19|20)\d\d\b")


def headings(path: Path) -> list[tuple[int, str]]:
    """The markdown headings of a page, outside fenced code (where '#' is a comment)."""
    out, fence = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.append((i, line))
    return out


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_no_dated_heading_outside_the_log():
    dated = [f"{p.relative_to(REPO)}:{i}: {h}" for p in pages() if p.name != "log.md"
             for i, h in headings(p) if DATE.search(h)]
    assert not dated, dated


def test_the_log_is_dated_and_newest_first():
    dates = [DATE.search(h)[0] for _, h in headings(REPO / "docs" / "log.md")
             if h.startswith("## ")]
    assert dates and all(d.startswith("20") for d in dates)
    assert dates == sorted(dates, reverse=True), dates


def test_the_pattern_catches_what_it_says():
    assert DATE.search("## Speed (2026-12-02) {#speed}")
    assert DATE.search("### Demo (2026")
    assert not DATE.search("## Train step: `cpu_small` on 2 cores, N=2048")
    assert headings(REPO / "docs" / "log.md")[0] == (1, "# Log")


def test_ten_common_tasks_are_written_once():
    holders = [p.relative_to(REPO) for p in pages() if "# 10. " in p.read_text()]
    assert holders == [Path("README.md")], holders


def test_the_fine_tuning_section_claims_only_what_its_command_shows():
    """The export page once said fine-tuning at M improves the model at every M, which its
    own table did not show (LoRA was worse at every M, from too high a learning rate); it
    now states what the table shows, with its before → after figures and the cause of the
    old result, next to the command that prints it, and leaves recovery at a new M to the
    claims page."""
    text = (REPO / "docs" / "export.md").read_text()
    assert "ode-lm finetune-table --depths=3,6,12" in text
    assert "What it shows" in text and "573.2 → 593.7" in text and "claims.md" in text
    assert not re.search(r"improves? (?:it|the model) at every M", text), "unmeasured claim"
