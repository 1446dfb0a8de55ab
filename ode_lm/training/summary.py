"""The run summary's depth table, from named eval figures alone (no jax), so
``ode-lm train``'s last lines and the docs' demo table (tools/doc_tables.py, from the run's
``summary.json``) are one text."""

from __future__ import annotations

from collections.abc import Mapping

from ode_lm.models.solve import Solve
from ode_lm.training import metric_names as names
from ode_lm.training.metric_names import GAP_PREFIX, LOSS, NFE, PERPLEXITY, TOKENS


def depth_table(results: Mapping[str, float], settings: Mapping[str, Solve]
                ) -> tuple[list[str], set[str]]:
    """The run summary's table of validation perplexity at each evaluated setting (fixed
    grids by solver then N, adaptive solvers last with their mean NFE; each with its depth
    gap when ``results`` has it), and the result keys it shows; ``([], set())`` without
    settings."""
    order = sorted(settings.items(), key=lambda kv: (kv[1].adaptive, kv[1].solver or "",
                                                     kv[1].num_steps or 0, kv[1].rtol or 0.0))
    rows, shown = [], {names.name(TOKENS)}
    for suffix, solve in order:
        ppl = results.get(names.name(PERPLEXITY, suffix))
        if ppl is None:
            continue
        if solve.adaptive:
            setting = f"rtol={solve.rtol:g}"
            note = f"mean NFE {results[names.name(NFE, suffix)]:.1f}"
        else:
            setting, note = f"N={solve.num_steps}", "(the run's own N)" if not suffix else ""
        gap_key = names.gap_name(suffix)
        gap = f"{results[gap_key]:+.1%}" if suffix and gap_key in results else ""
        rows.append(f"  {solve.solver or '':<9} {setting:<11} {ppl:>9.1f} {gap:>7}  {note}"
                    .rstrip())
        shown |= {names.name(PERPLEXITY, suffix), names.name(NFE, suffix), gap_key}
        if suffix:
            shown.add(names.name(LOSS, suffix))
    if not rows:
        return [], set()
    tokens = results.get(names.name(TOKENS))
    over = f" over {tokens:,.0f} tokens" if tokens is not None else ""
    gapped = any(k.startswith(GAP_PREFIX) for k in results)
    gaps = " and its gap to the run's own N" if gapped else ""
    caption = f"one set of weights, solved with N steps (validation perplexity{over}{gaps}):"
    return [caption, *rows], shown
