"""CI: the demo's printed summary keeps the depth promise.

Reads what `ode-lm train --gin_file=configs/runs/demo.gin` printed (its depth table, one
row per setting: `  euler     N=4          123.4   +1.2%`) and fails unless Euler perplexity at
N = 4, 8 and 12 is within 10 % of the trained N=6 figure and the adaptive row is there.
"""

from __future__ import annotations

import re
import sys

TRAINED_N, CHECKED_N, TOLERANCE = 6, (4, 8, 12), 0.10


def main(path: str) -> int:
    text = open(path, encoding="utf-8").read()
    euler = {int(n): float(p) for n, p in re.findall(r"^\s+euler\s+N=(\d+)\s+([\d.]+)", text,
                                                     flags=re.M)}
    adaptive = re.findall(r"^\s+adaptive\s+rtol=\S+\s+([\d.]+)\s+(?:[+-][\d.]+%\s+)?mean NFE", text, flags=re.M)
    missing = [n for n in (TRAINED_N, *CHECKED_N) if n not in euler]
    if missing or not adaptive:
        print(f"check_demo: {path}: no depth table rows for Euler N={missing} "
              f"or the adaptive solver", file=sys.stderr)
        return 1
    base = euler[TRAINED_N]
    worst = max(abs(euler[n] / base - 1) for n in CHECKED_N)
    rows = ", ".join(f"N={n} {euler[n]:.1f}" for n in sorted(euler))
    print(f"check_demo: Euler {rows}; adaptive {adaptive[0]}; worst of N=4/8/12 vs N=6: "
          f"{worst:+.1%} (limit {TOLERANCE:.0%})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
