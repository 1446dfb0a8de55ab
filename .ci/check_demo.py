"""CI: the demo's printed summary keeps the depth promise of the default recipe.

Reads what `ode-lm train --gin_file=configs/runs/demo.gin` printed (its depth table, one
row per setting: `  euler     N=4          123.4   +1.2%`) and fails unless every row is
within its limit of the trained N=6 figure. The limits are looser than the documented
figures (docs/depth.md), which hold on one host's numerics: they catch a recipe that breaks,
not a change in the last digit.
"""

from __future__ import annotations

import re
import sys

TRAINED_N = 6
# setting -> largest gap to Euler at the trained N
LIMITS = {("euler", 2): 0.25, ("euler", 3): 0.10, ("euler", 4): 0.05, ("euler", 8): 0.05,
          ("euler", 12): 0.05, ("euler", 24): 0.05, ("rk4", 8): 0.05, ("adaptive", None): 0.05}


def main(path: str) -> int:
    text = open(path, encoding="utf-8").read()
    rows = {}
    for solver, n, ppl in re.findall(r"^\s+(euler|rk4|midpoint)\s+N=(\d+)\s+([\d.]+)", text,
                                     flags=re.M):
        rows[(solver, int(n))] = float(ppl)
    adaptive = re.findall(r"^\s+adaptive\s+rtol=\S+\s+([\d.]+)\s", text, flags=re.M)
    if adaptive:
        rows[("adaptive", None)] = float(adaptive[0])
    missing = [k for k in (*LIMITS, ("euler", TRAINED_N)) if k not in rows]
    if missing:
        print(f"check_demo: {path}: no depth table rows for {missing}", file=sys.stderr)
        return 1
    base = rows[("euler", TRAINED_N)]
    failed = []
    for key, limit in LIMITS.items():
        gap = rows[key] / base - 1
        name = f"{key[0]} N={key[1]}" if key[1] is not None else key[0]
        print(f"check_demo: {name:<14} {rows[key]:8.1f} {gap:+7.1%} (limit {limit:.0%})")
        if gap > limit:
            failed.append(name)
    if failed:
        print(f"check_demo: over the limit: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
