"""Nothing of the machine ode-lm was developed on is in the product (ode_lm/, tools/): no
issue numbers, no core counts or targets of one host, no call of a development tool. Such
text is wrong on every other machine and means nothing to a reader without the tracker."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PATTERNS = {
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "a core count of one host": re.compile(r"\b(?:\d+|two|four)[- ]cores?\b", re.I),
    "a development tool's call": re.compile(
        r"\brun\(command=|\bcarry=\[|\btimeout_s=\d|\brun tool\b|\bgive_back\b|\.library/"
        r"|\blent (?:an? )?(?:H\d+|GPU|machine)", re.I),
}


def product_files() -> list[Path]:
    files = [p for d in ("ode_lm", "tools") for p in (REPO / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".sh", ".md", ".txt", ".json", ".gin")]
    assert len(files) > 50
    return files


def test_no_development_machine_in_the_product():
    hits = [f"{p.relative_to(REPO)}:{i}: {what}: {line.strip()[:80]}"
            for p in product_files()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            for what, pattern in PATTERNS.items() if pattern.search(line)]
    assert not hits, hits


def test_the_patterns_catch_what_they_say():
    assert PATTERNS["an issue number"].search("Targets of issue 6")
    assert PATTERNS["a core count of one host"].search("on the 2-core CPU")
    assert PATTERNS["a development tool's call"].search('run(command="bash x", carry=["w"])')
    assert not any(p.search("this host's rows; a release; 16 CPU-seconds")
                   for p in PATTERNS.values())


DOC_PATTERNS = {
    "the development machine": re.compile(r"\bdevelopment machine\b", re.I),
    "an issue number": PATTERNS["an issue number"],
    "one accelerator image": re.compile(r"\bthe H\d+ image\b", re.I),
    "a heading naming one host's cores": re.compile(r"^#+ .*\b(?:\d+|two|four)[- ]cores?\b",
                                                    re.I),
}


def test_no_development_machine_in_the_docs():
    """The docs describe the product (measurements say where they were taken, in the line
    that gives them); no page but the log, the history, speaks of the machine ode-lm was
    developed on or of the tracker's issues."""
    pages = [p for p in (REPO / "docs").glob("*.md") if p.name != "log.md"]
    assert len(pages) > 10
    hits = [f"{p.relative_to(REPO)}:{i}: {what}: {line.strip()[:80]}"
            for p in pages
            for i, line in enumerate(p.read_text().splitlines(), 1)
            for what, pattern in DOC_PATTERNS.items() if pattern.search(line)]
    assert not hits, hits
