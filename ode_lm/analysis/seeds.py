"""Seed groups of depth-gap records: each group's mean, and its paired difference to a baseline.

Two recipes trained with the same seed start from the same weights and see the same batches,
so the fair comparison is seed by seed: the mean of the per-seed differences, with its
standard error (sample standard deviation / √pairs), rather than two means whose spread is
mostly the seeds'. A run joins a group by its name, ``GROUP, seed S`` (as the docs' tables
write it); ``ode-lm depth-gap table --baseline=GROUP`` is the CLI.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

_NAME = re.compile(r"^(?P<group>.+), seed (?P<seed>\S+)$")


def group_of(label: str) -> tuple[str, str]:
    """``'default, seed 3'`` → ``('default', '3')``; any other name is refused in one line."""
    match = _NAME.match(label)
    if match is None:
        raise ValueError(f"{label!r}: a run compared by seed is named 'GROUP, seed S' "
                         "(e.g. 'default, seed 0')")
    return match["group"], match["seed"]


def seed_groups(records: list[dict]) -> dict[str, dict[str, dict]]:
    """group → seed → record, in the order the runs were given. Refused: a seed twice in one
    group (it would be counted twice), and runs of different solvers (a column's N is each
    run's own solver, so their figures would not be the same setting)."""
    groups: dict[str, dict[str, dict]] = {}
    for record in records:
        group, seed = group_of(record["label"])
        if seed in groups.setdefault(group, {}):
            raise ValueError(f"{record['label']!r}: seed {seed} of {group!r} is given twice")
        groups[group][seed] = record
    solvers = {r["solver"] for r in records}
    if len(solvers) > 1:
        raise ValueError(f"runs of different solvers ({', '.join(sorted(solvers))}) are not "
                         "compared by seed: their N columns are different solves")
    return groups


def _perplexity(record: dict, setting: str) -> float | None:
    cell = record["cells"].get(setting)
    return None if cell is None else cell.get("perplexity")


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (None from a single value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def group_mean(group: str, runs: dict[str, dict]) -> dict[str, Any]:
    """One group's row: per setting, the mean perplexity and its standard error over the
    seeds that measured it, and the mean gap to each run's own N."""
    records = list(runs.values())
    cells: dict[str, dict | None] = {}
    for setting in records[0]["cells"]:
        measured = [r["cells"][setting] for r in records
                    if _perplexity(r, setting) is not None]
        if not measured:
            cells[setting] = None
            continue
        mean, se = _mean_se([c["perplexity"] for c in measured])
        cells[setting] = {"perplexity": mean, "se": se, "seeds": len(measured)}
        for key in ("gap", "nfe"):  # nfe: the adaptive solve's mean evaluations
            if all(c.get(key) is not None for c in measured):
                cells[setting][key] = statistics.fmean(c[key] for c in measured)
    steps = {r["step"] for r in records}
    return {"kind": "mean", "label": f"{group}, mean of {len(records)}", "group": group,
            "seeds": list(runs), "step": steps.pop() if len(steps) == 1 else None,
            "num_steps": records[0]["num_steps"], "solver": records[0]["solver"],
            "cells": cells}


def paired_difference(group: str, runs: dict[str, dict], baseline: str,
                      base_runs: dict[str, dict]) -> dict[str, Any]:
    """``group − baseline`` over the seeds both have: per setting, the mean perplexity
    difference, its standard error, and the mean relative difference."""
    seeds = [s for s in runs if s in base_runs]
    if not seeds:
        raise ValueError(f"{group!r} and the baseline {baseline!r} share no seed: nothing to "
                         f"pair ({group}: {', '.join(runs)}; {baseline}: {', '.join(base_runs)})")
    cells: dict[str, dict | None] = {}
    for setting in runs[seeds[0]]["cells"]:
        pairs = [(_perplexity(runs[s], setting), _perplexity(base_runs[s], setting))
                 for s in seeds]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            cells[setting] = None
            continue
        diff, se = _mean_se([a - b for a, b in pairs])
        cells[setting] = {"difference": diff, "se": se, "pairs": len(pairs),
                          "relative": statistics.fmean(a / b - 1 for a, b in pairs)}
    steps = {runs[s]["step"] for s in seeds} | {base_runs[s]["step"] for s in seeds}
    return {"kind": "paired", "label": f"{group} − {baseline}, paired over {len(seeds)}",
            "group": group, "baseline": baseline, "seeds": seeds,
            "step": steps.pop() if len(steps) == 1 else None, "cells": cells}


def summarise(records: list[dict], baseline: str) -> list[dict]:
    """Each group's mean row, then each other group's paired difference to ``baseline``."""
    groups = seed_groups(records)
    if baseline not in groups:
        raise ValueError(f"--baseline={baseline!r}: no run named '{baseline}, seed S' "
                         f"(groups: {', '.join(groups)})")
    rows = [group_mean(g, runs) for g, runs in groups.items()]
    rows += [paired_difference(g, runs, baseline, groups[baseline])
             for g, runs in groups.items() if g != baseline]
    return rows
