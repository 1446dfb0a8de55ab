"""The self-speculative decoding figure of docs/export.md, from `ode-lm sample --json` files.

    ode-lm sample --model_dir=RUN --prompt=... --temperature=0 --draft=euler:2 \\
        --draft_tokens=1,2,3,4,6,8 --json=speculative_<name>.json
    python tools/speculative_figure.py speculative_*.json --out speculative.png

Left: the share of draft tokens the verifier accepts against k; right: tokens/s of
self-speculative decoding over plain decoding at the verifier's solve (the same run, the
same prompts, timed alternately). One line per JSON, labelled by its file name.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    fig, (acc, speed) = plt.subplots(1, 2, figsize=(9, 3.4))
    for path in args.json:
        data = json.loads(path.read_text())
        rows = sorted(data["rows"], key=lambda r: r["draft_tokens"])
        ks = [r["draft_tokens"] for r in rows]
        d, v = rows[0]["draft"], rows[0]["verify"]
        label = f"{path.stem.removeprefix('speculative_')} ({d[1]}:{d[0]} -> {v[1]}:{v[0]})"
        acc.plot(ks, [100 * r["acceptance"] for r in rows], marker="o", label=label)
        speed.plot(ks, [r["speedup"] for r in rows], marker="o", label=label)
    acc.set(xlabel="draft tokens per verify (k)", ylabel="draft tokens accepted (%)",
            ylim=(-3, 103), title="acceptance")
    speed.axhline(1.0, color="k", lw=0.6, ls="--")
    speed.set(xlabel="draft tokens per verify (k)", ylabel="tokens/s over plain decoding",
              title="speed (greedy, identical output)")
    acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
