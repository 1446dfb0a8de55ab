"""Regenerate the tables of README.md and docs/*.md from the JSON under docs/data/.

One owner per figure: a table between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``
is written from ``docs/data/NAME.json`` and nowhere else, so a page cannot drift from the
run that made it. Each JSON is what a command wrote, provenance included (command, commit,
date, machine: ``ode_lm.provenance``):

    demo_depth   ode-lm train --gin_file=configs/runs/demo.gin  (MODEL_DIR/summary.json)
    depth_*      ode-lm depth-gap table NAME=DIR ... --json=FILE
    recipe_cost  ode-lm bench --config tiny --sections=recipe --json=FILE
    claims_*     ode-lm reproduce ... --json=FILE
    speculative_* ode-lm sample --draft=... --draft_tokens=k,... --json=FILE

    python tools/doc_tables.py --write                 # rewrite every page from the JSON
    python tools/doc_tables.py --check                 # exit 1 naming each page and table
                                                       # that differs (CI)
    python tools/doc_tables.py --from-demo RUN_DIR     # docs/data/demo_depth.json from a
                                                       # demo run's summary.json, then --write
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"(?P<open><!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                    r"(?P<close><!-- /table:(?P=name) -->)", re.S)


def _source_line(name: str, data: dict) -> str:
    """Where the figures came from, in one line under the table."""
    prov = data.get("provenance") or {}
    where = f"`docs/data/{name}.json`"
    if prov.get("source"):
        return f"<sub>From {where}: {prov['source']}.</sub>"
    machine = prov.get("machine") or {}
    load = machine.get("load_average")
    parts = [str(prov.get("date", "undated"))[:10]]
    if machine.get("cpu"):
        parts.append(f"{machine['cpu']}, {machine.get('cores', '?')} cores"
                     + (f", load {load[0]:.1f}" if load else ""))
    if prov.get("commit"):
        parts.append(f"commit {prov['commit'][:10]}")
    return f"<sub>From {where}: {'; '.join(parts)}.</sub>"


def render_demo(data: dict) -> str:
    """The depth table ``ode-lm train`` prints at the end of a run, from its summary.json."""
    from ode_lm.models.solve import Solve
    from ode_lm.training.summary import depth_table

    settings = {k: Solve(**v) for k, v in data["settings"].items()}
    lines, _ = depth_table(data["eval"], settings)
    if not lines:
        raise ValueError("no depth table in the summary (a run without eval settings?)")
    return "```text\n" + "\n".join(lines) + "\n```"


def render_depth_gap(data: dict) -> str:
    """``ode-lm depth-gap table``'s markdown, without the load-bound tok/s column."""
    from ode_lm.commands.depth_gap import format_table

    return format_table(data["runs"], speed=False, summary=data.get("summary"))


def render_recipe_cost(data: dict) -> str:
    """The recipe group of ``ode-lm bench --sections=recipe``: step and CPU time relative to
    the first recipe (the depth-robust one), FLOP per step, compiled peak memory, compile."""
    rows = data["groups"]["recipe"]
    lines = ["| recipe file | step time (rel) | CPU time (rel) | GFLOP/step | "
             "compiled peak memory | compile |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(rows):
        step = f"{r['relative_step_time']:.3f}"
        if i == 0:
            step += f" ({1e3 * r['step_s_median']:.1f} ms)"
        elif r["variant"] == "default":
            step = f"**{step}**"
        programs = r.get("programs", 1)
        name = r["variant"].removesuffix(".gin")
        lines.append(
            f"| `{name}.gin` | {step} | {r['relative_cpu_time']:.3f} | "
            f"{r['flops_per_step'] / 1e9:.2f} | {r['compiled_peak_bytes'] / 2**20:.1f} MiB | "
            f"{programs} program{'s' if programs != 1 else ''}, {r['compile_s']:.1f} s |")
    return "\n".join(lines)


def render_claims(data: dict) -> str:
    """``ode-lm reproduce``'s verdict table (its claims.json)."""
    from ode_lm.claims.report import format_table

    return format_table(data)


def render_speculative(data: dict) -> str:
    """``ode-lm sample --draft=... --draft_tokens=k,... --json``: one row per k."""
    rows = sorted(data["rows"], key=lambda r: r["draft_tokens"])
    d, v = rows[0]["draft"], rows[0]["verify"]
    lines = [f"| k (draft {d[1]}:{d[0]}, verify {v[1]}:{v[0]}) | accepted | tokens/verify | "
             "tokens/s | plain tokens/s | speed-up | output |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        same = "identical" if r["identical"] else "differs"
        lines.append(f"| {r['draft_tokens']} | {100 * r['acceptance']:.0f} % | "
                     f"{r['tokens_per_verify']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['plain_tokens_per_s']:,.0f} | {r['speedup']:.2f}x | {same} |")
    return "\n".join(lines)


def renderer(name: str) -> Callable[[dict], str]:
    """Which command's JSON a table name holds: ``demo_*`` a train summary, ``depth_*`` a
    depth-gap table, ``recipe_cost`` a bench, ``claims_*`` a reproduce suite,
    ``speculative_*`` a self-speculative ``sample``."""
    if name.startswith("demo_"):
        return render_demo
    if name.startswith("depth_"):
        return render_depth_gap
    if name == "recipe_cost":
        return render_recipe_cost
    if name.startswith("claims_"):
        return render_claims
    if name.startswith("speculative_"):
        return render_speculative
    raise KeyError(f"no renderer for table {name!r}")


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(name: str, root: Path) -> str:
    path = root / "docs" / "data" / f"{name}.json"
    data = json.loads(path.read_text())
    return f"{renderer(name)(data)}\n\n{_source_line(name, data)}\n"


def regenerate(root: Path, write: bool) -> list[str]:
    """Every marked table of every page rendered from its JSON; ``write``: the pages are
    rewritten. Returns 'PAGE: table NAME' for each table that differed."""
    differ, cache = [], {}
    for page in pages(root):
        text, parts, end = page.read_text(), [], 0
        for m in MARKER.finditer(text):
            name = m["name"]
            if name not in cache:
                cache[name] = render(name, root)
            if m["body"] != cache[name]:
                differ.append(f"{page.relative_to(root)}: table {name}")
            parts += [text[end:m.start()], m["open"], cache[name], m["close"]]
            end = m.end()
        new = "".join(parts) + text[end:]
        if write and new != text:
            page.write_text(new)
    return differ


def from_demo(source: Path, root: Path) -> Path:
    """Copy a demo run's summary.json (the run directory or the file) to
    docs/data/demo_depth.json."""
    path = source / "summary.json" if source.is_dir() else source
    data = json.loads(path.read_text())
    if "eval" not in data or "settings" not in data:
        raise ValueError(f"{path}: not an `ode-lm train` summary.json")
    out = root / "docs" / "data" / "demo_depth.json"
    shutil.copyfile(path, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the pages")
    mode.add_argument("--check", action="store_true", help="exit 1 if a page differs")
    mode.add_argument("--from-demo", type=Path, metavar="RUN_DIR_OR_SUMMARY",
                      help="take the demo table from this run, then --write")
    p.add_argument("--root", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.from_demo:
        print(f"wrote {from_demo(args.from_demo, args.root)}")
    differ = regenerate(args.root, write=not args.check)
    for line in differ:
        if args.check:
            print(f"doc_tables: {line} differs from docs/data "
                  "(python tools/doc_tables.py --write)", file=sys.stderr)
        else:
            print(f"rewrote {line}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
