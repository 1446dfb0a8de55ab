"""The analytic communication minimum of a train step under FSDP, what the compiled program
gathers (coefficients A or generated W(t)), and the report's text and JSON layout.

Analytic minimum per chip, pure FSDP (bytes under hlo_report's conventions: an all-gather
counts the gathered tensor, a reduce-scatter its full input):
- every weight set a step uses is gathered twice, forward and backward (2 bytes an element:
  TPUs feed the MXU bf16 at default precision, and XLA converts before it gathers);
- the gradient of what was gathered is reduce-scattered once (float32, 4 bytes).
For an ODE kernel of P elements the step uses either the D+1 coefficient sets (W₀ and A) or
the N·stages generated sets W(t_k); the cheaper is min(N·stages, D+1)·P. A discrete model
uses its L layer sets. Everything else (embeddings, head, norms, time MLPs, bias factors) is
gathered as stored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ode_lm.bench.hlo_report import ProgramCost

GATHER_BYTES = 2  # bf16
GRAD_BYTES = 4  # float32


@dataclasses.dataclass(frozen=True)
class CommModel:
    """Analytic FSDP traffic of one step and the ODE's A-vs-W(t) choice."""

    bytes_per_chip: float
    kernel_elements: int  # P summed over the hypernetwork (or layer) kernels
    generated_sets: int  # N·stages (ODE) or L (discrete)
    coefficient_sets: int  # D+1 (ODE); 0 for a discrete model
    other_elements: int

    @property
    def cheaper(self) -> str:
        if not self.coefficient_sets:
            return "layer weights"
        return "W(t)" if self.generated_sets <= self.coefficient_sets else "A"


def _leaves(tree: Any, prefix: tuple[str, ...] = ()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, prefix + (str(k),))
    else:
        yield prefix, tree


def analytic_min(abstract_params: dict, *, evaluations: int, time_embed_dim: int,
                 ode: bool) -> CommModel:
    """Analytic minimum (module docstring) from the model's abstract parameter tree."""
    kernels = other = 0
    leaves = dict(_leaves(abstract_params))
    for path, x in leaves.items():
        n = math.prod(x.shape)
        if ode and path[-1] == "a" and path[:-1] + ("w0",) in leaves:
            kernels += n // time_embed_dim
        elif ode and path[-1] == "w0" and path[:-1] + ("a",) in leaves:
            continue
        elif not ode and path[0] == "blocks" and "kernel" in path[-1]:
            kernels += n // evaluations
        else:
            other += n
    coef = time_embed_dim + 1 if ode else 0
    sets = min(evaluations, coef) if ode else evaluations
    gathered = kernels * sets + other
    total = gathered * (2 * GATHER_BYTES + GRAD_BYTES)
    return CommModel(float(total), kernels, evaluations, coef, other)


def gathered_weights(cost: ProgramCost, abstract_params: dict, *,
                     time_embed_dim: int) -> dict[str, float]:
    """Gathered bytes per chip (all-gathers, and all-reduces that gather: see hlo_report)
    split into coefficients A (a leading D axis on a hypernetwork kernel's elements), W(t)
    (a kernel's elements, once or with a leading steps axis) and other."""
    sizes = {math.prod(x.shape[1:]) for p, x in _leaves(abstract_params)
             if p[-1] == "a" and len(x.shape) > 1}
    out = {"A": 0.0, "W(t)": 0.0, "other": 0.0}
    for c in cost.collectives:
        for shape, nbytes in c.gathered:
            dims = [d for d in shape if d != 1]
            n = math.prod(dims)
            if dims and dims[0] == time_embed_dim and n // time_embed_dim in sizes:
                slot = "A"
            elif n in sizes or (dims and n // dims[0] in sizes):
                slot = "W(t)"
            else:
                slot = "other"
            out[slot] += nbytes * c.multiplicity
    return out


def report_json(cost: ProgramCost, comm: CommModel, estimate, *, gathers: dict | None,
                flops_per_chip_analytic: float) -> dict:
    """The --json layout of one compiled step (all values per chip, estimates labelled)."""
    return {
        "collectives": cost.by_kind(),
        "collective_bytes_per_chip": cost.collective_bytes,
        "analytic_min_bytes_per_chip": comm.bytes_per_chip,
        "in_loop_collectives": dict(zip(("count", "bytes_per_chip"),
                                        cost.in_loop_collectives(), strict=True)),
        "loops": [{"name": lp.name, "trip_count": lp.trip_count, "found_by": lp.how,
                   "executions": lp.multiplicity} for lp in cost.loops],
        "gathers_bytes_per_chip": gathers,
        "analytic_choice": {"cheaper": comm.cheaper, "generated_sets": comm.generated_sets,
                            "coefficient_sets": comm.coefficient_sets},
        "flops_per_chip": {"hlo_dots_with_trip_counts": cost.flops,
                           "analytic_model": flops_per_chip_analytic},
        "hbm_bytes_per_chip": cost.hbm_bytes,
        "estimate": {"step_s": estimate.step_s, "mfu": estimate.mfu, "bound": estimate.bound,
                     "compute_s": estimate.compute_s, "memory_s": estimate.memory_s,
                     "communication_s": estimate.communication_s},
    }


def describe_comm(cost: ProgramCost, comm: CommModel, estimate, gathers: dict | None,
                  flops_analytic: float, label: str = "") -> list[str]:
    """Text lines for the tool's report."""
    mib = 1024**2
    tag = f" {label}" if label else ""
    lines = []
    for lp in cost.loops:
        lines.append(f"loop{tag}      {lp.name}: {lp.trip_count} trips ({lp.how}), "
                     f"{lp.multiplicity} executions per step")
    kinds = cost.by_kind()
    lines.append(f"comm{tag}      " + " | ".join(
        f"{k} {v['count']}x {v['bytes_per_chip'] / mib:.1f} MiB" for k, v in kinds.items()))
    ratio = cost.collective_bytes / comm.bytes_per_chip if comm.bytes_per_chip else math.nan
    lines.append(f"comm/chip{tag} {cost.collective_bytes / mib:.1f} MiB per step vs analytic "
                 f"FSDP minimum {comm.bytes_per_chip / mib:.1f} MiB (x{ratio:.2f})")
    if comm.coefficient_sets:
        got = ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in (gathers or {}).items())
        lines.append(f"gathers{tag}   program gathers: {got}; cheaper for this config: "
                     f"{comm.cheaper} (N·stages={comm.generated_sets} vs "
                     f"D+1={comm.coefficient_sets})")
    fr = cost.flops / flops_analytic if flops_analytic else math.nan
    lines.append(f"FLOPs{tag}     HLO dots x trip counts {cost.flops:.3e} per chip vs analytic "
                 f"{flops_analytic:.3e} (ratio {fr:.2f}); HBM {cost.hbm_bytes / 2**30:.2f} GiB")
    lines.append(
        f"estimate{tag}  step {estimate.step_s * 1e3:.1f} ms (compute "
        f"{estimate.compute_s * 1e3:.1f}, memory {estimate.memory_s * 1e3:.1f}, "
        f"communication {estimate.communication_s * 1e3:.1f} ms): {estimate.bound}-bound, "
        f"MFU {100 * estimate.mfu:.1f}% (roofline estimate, not a measurement)")
    return lines
