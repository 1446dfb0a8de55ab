"""Communication and roofline report of one compiled step, from its post-optimisation HLO.

Everything is per chip (an SPMD program is one chip's program) and multiplied by loop trip
counts: each computation's count is weighted by how often one run of the entry executes it
(while bodies x trip count, nested loops multiply; fusions, calls and async wrappers x 1;
each branch of a conditional x 1, an upper bound).

Conventions (bytes per chip, from the HLO shapes):
- all-gather: output bytes (the gathered tensor);
- reduce-scatter: operand (input) bytes;
- all-reduce, all-to-all, collective-permute: operand bytes (= output bytes).
Async pairs count once, at the start (``*-start``, ``async-start``, TPU's
``AsyncCollectiveStart`` fusions). TPU's continuation fusions repeat an in-flight collective
(same ``channel_id``) in every fusion that overlaps it, and in the done fusion, even inside a
loop body that runs while it is in flight: such a collective counts once, where it starts;
other collectives count once per channel id and execution of their loop body / entry. An
all-reduce read only through dynamic-slices (TPU's all-reduce-scatter fusion) is a
reduce-scatter. An all-reduce
of a shard written into zeros is XLA's all-gather-as-all-reduce: it stays an all-reduce
here, and ``Collective.gathered`` names the arrays it gathers.

FLOPs: dot and convolution FLOPs counted from the HLO (2 per multiply-add), with trip
counts; elementwise work is ignored (it is memory-bound and lands in the HBM term).
HBM bytes: operand + result bytes of every top-level instruction (a fusion is one
instruction; a fused parameter read only through slices counts the slices, an in-place
dynamic-update-slice counts the update, a parameter returned unchanged counts nothing),
with trip counts. Both are estimates.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

from ode_lm.bench.hlo_parse import Computation, Instruction, parse_module, shape_bytes, trip_count

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_KIND_OF = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}
_DONE = {"all-gather-done", "all-reduce-done", "collective-permute-done", "async-done",
         "async-update", "copy-done", "send-done", "recv-done"}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
         "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency", "iota"} | _DONE


@dataclasses.dataclass
class Collective:
    kind: str
    name: str
    computation: str
    bytes: float  # per execution, per chip (convention above)
    multiplicity: int  # executions per step
    in_loop: bool
    shape: tuple[int, ...]
    # arrays this collective gathers: an all-gather's output, or the operands of an
    # all-reduce that are a shard written into zeros (XLA's all-gather as all-reduce)
    gathered: list = dataclasses.field(default_factory=list)  # [(dims, bytes)]


@dataclasses.dataclass
class Loop:
    name: str
    computation: str  # the caller
    trip_count: int
    how: str
    multiplicity: int  # executions of the body per step


@dataclasses.dataclass
class ProgramCost:
    """Per-chip totals of one run of the program, loops multiplied out."""

    collectives: list[Collective]
    loops: list[Loop]
    flops: float
    hbm_bytes: float

    def by_kind(self) -> dict[str, dict[str, float]]:
        out = {k: {"count": 0, "bytes_per_chip": 0.0} for k in KINDS}
        for c in self.collectives:
            slot = out.setdefault(c.kind, {"count": 0, "bytes_per_chip": 0.0})
            slot["count"] += c.multiplicity
            slot["bytes_per_chip"] += c.bytes * c.multiplicity
        return out

    @property
    def collective_bytes(self) -> float:
        return sum(c.bytes * c.multiplicity for c in self.collectives)

    def in_loop_collectives(self) -> tuple[int, float]:
        cs = [c for c in self.collectives if c.in_loop]
        return sum(c.multiplicity for c in cs), sum(c.bytes * c.multiplicity for c in cs)


def _starts_async(instr: Instruction, users: dict[str, list[Instruction]]) -> bool:
    return any(u.opcode == "custom-call" and "AsyncCollectiveStart" in u.attrs
               for u in users.get(instr.name, []))


def _kind(instr: Instruction, users: dict[str, list[Instruction]]) -> str | None:
    kind = _KIND_OF.get(instr.opcode)
    if kind == "all-reduce" and instr.opcode == "all-reduce":
        us = users.get(instr.name, [])
        us = [v for u in us for v in (users.get(u.name, []) if u.opcode == "get-tuple-element"
                                      else [u])]
        if us and all(u.opcode == "dynamic-slice" for u in us):
            return "reduce-scatter"
    return kind


def _collective_bytes(kind: str, instr: Instruction, comp: Computation) -> float:
    operand_bytes = sum(shape_bytes(comp.instructions[o].shape) for o in instr.operands
                        if o in comp.instructions)
    if kind == "all-gather":
        arrays = instr.shape
        if instr.opcode.endswith("-start"):  # (operands..., outputs...)
            arrays = arrays[len(arrays) // 2:]
        return shape_bytes(arrays)
    return operand_bytes


def _is_padded_shard(comp: Computation, comps: dict, name: str, depth: int = 0) -> bool:
    """Is `name` a dynamic-update-slice into a broadcast (through copies / fusions)?"""
    instr = comp.instructions.get(name)
    if instr is None or depth > 6:
        return False
    if instr.opcode in ("copy-done", "copy-start", "copy", "bitcast") and instr.operands:
        return _is_padded_shard(comp, comps, instr.operands[0], depth + 1)
    if instr.opcode == "dynamic-update-slice":
        base = comp.instructions.get(instr.operands[0])
        return base is not None and base.opcode in ("broadcast", "constant", "parameter")
    if instr.opcode == "fusion":
        fused = comps.get(dict(instr.called()).get("calls", ""))
        return fused is not None and fused.root.opcode == "dynamic-update-slice"
    return False


def _gathered(kind: str, instr: Instruction, comp: Computation, comps: dict) -> list:
    if kind == "all-gather":
        arrays = instr.shape[len(instr.shape) // 2:] if instr.opcode.endswith("-start") \
            else instr.shape
        return [(a.dims, a.bytes) for a in arrays]
    if kind != "all-reduce":
        return []
    out = []
    for o in instr.operands:
        if o in comp.instructions and _is_padded_shard(comp, comps, o):
            out += [(a.dims, a.bytes) for a in comp.instructions[o].shape]
    return out


def dot_flops(instr: Instruction, comp: Computation) -> float:
    """2 x multiply-adds of a dot or convolution (0 for anything else)."""
    if instr.opcode not in ("dot", "convolution") or not instr.shape:
        return 0.0
    out = instr.shape[0].elements
    if instr.opcode == "dot":
        lhs = comp.instructions.get(instr.operands[0])
        dims = instr.attr("lhs_contracting_dims") or "{}"
        contract = [int(d) for d in re.findall(r"\d+", dims)]
        if lhs is None or not lhs.shape:
            return float("nan")
        return 2.0 * out * math.prod(lhs.shape[0].dims[d] for d in contract)
    lhs, rhs = (comp.instructions.get(o) for o in instr.operands[:2])
    labels = instr.attr("dim_labels") or ""
    m = re.fullmatch(r"([^_]+)_([^-]+)->(.+)", labels)
    if lhs is None or rhs is None or not lhs.shape or not rhs.shape or not m:
        return float("nan")
    lhs_l, rhs_l, out_l = m.groups()
    kernel_in = rhs.shape[0].dims[rhs_l.index("i")]
    non_spatial = math.prod(d for d, c in zip(instr.shape[0].dims, out_l, strict=True)
                            if not c.isdigit())
    window = _window(instr.attr("window") or "")
    taps = 1
    for axis in range(sum(c.isdigit() for c in out_l)):
        w = {k: v[axis] for k, v in window.items()}
        taps *= _valid_taps(lhs.shape[0].dims[lhs_l.index(str(axis))],
                            instr.shape[0].dims[out_l.index(str(axis))], **w)
    return 2.0 * non_spatial * kernel_in * taps


def _window(text: str) -> dict[str, list]:
    """HLO window attribute -> per-spatial-dim size / pad / stride / dilations."""
    fields = dict(re.findall(r"(\w+)=([\dx_\-]+)", text))
    sizes = [int(v) for v in fields.get("size", "").split("x") if v]
    n = len(sizes)

    def ints(key: str, default: int) -> list[int]:
        return [int(v) for v in fields[key].split("x")] if key in fields else [default] * n

    pads = ([tuple(int(p) for p in v.split("_")) for v in fields["pad"].split("x")]
            if "pad" in fields else [(0, 0)] * n)
    return {"size": sizes, "pad": pads, "stride": ints("stride", 1),
            "lhs_dilate": ints("lhs_dilate", 1), "rhs_dilate": ints("rhs_dilate", 1)}


def _valid_taps(in_size: int, out_size: int, *, size: int, pad: tuple[int, int], stride: int,
                lhs_dilate: int, rhs_dilate: int) -> int:
    """Multiply-adds along one spatial dim summed over its outputs: window taps that land on
    a real (not padded, not a dilation hole) input element. TPU HLO writes dot batch and
    outer-product dims as convolutions with a padded window, so size x outputs overcounts."""
    last = (in_size - 1) * lhs_dilate
    total = 0
    for o in range(out_size):
        base = o * stride - pad[0]
        if lhs_dilate == 1:
            lo = max(0, math.ceil(-base / rhs_dilate))
            hi = min(size - 1, (last - base) // rhs_dilate)
            total += max(0, hi - lo + 1)
        else:
            total += sum(1 for k in range(size) if 0 <= (i := base + k * rhs_dilate) <= last
                         and i % lhs_dilate == 0)
    return total


def _fusion_hbm_bytes(instr: Instruction, fused: Computation | None,
                      comp: Computation) -> float:
    """Operand + result bytes of a fusion, reading sliced parameters as their slices."""
    out_bytes = shape_bytes(instr.shape)
    operands = [shape_bytes(comp.instructions[o].shape) if o in comp.instructions else 0.0
                for o in instr.operands]
    if fused is None:
        return out_bytes + sum(operands)
    users = fused.users()
    params = {}
    for p in fused.instructions.values():
        if p.opcode == "parameter" and (m := re.match(r"\s*(\d+)", p.attrs)):
            params[int(m[1])] = p
    root = fused.root
    roots = [fused.instructions[o] for o in root.operands] if root.opcode == "tuple" else [root]
    in_place = set()
    names = {p.name for p in params.values()}
    for r in roots:
        if r.opcode == "dynamic-update-slice" and r.operands[0] in names:
            in_place.add(r.operands[0])
            update = fused.instructions.get(r.operands[1])
            out_bytes -= shape_bytes(r.shape) - (shape_bytes(update.shape) if update else 0.0)
    passed = set()  # parameters returned unchanged (TPU continuation fusions carry the
    for r in roots:  # in-flight collective buffers through): no traffic either way
        if r.opcode == "parameter" and root.opcode == "tuple":
            passed.add(r.name)
            out_bytes -= shape_bytes(r.shape)
    total = out_bytes
    for i, nbytes in enumerate(operands):
        p = params.get(i)
        if p is None:
            total += nbytes
            continue
        if p.name in in_place or (p.name in passed and len(users.get(p.name, [])) == 1):
            continue
        us = users.get(p.name, [])
        if us and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == p.name
                      for u in us):
            total += sum(shape_bytes(u.shape) for u in us)
        else:
            total += nbytes
    return total


def analyze(hlo_text: str) -> ProgramCost:
    """Collectives, dot FLOPs and HBM bytes of one run of the module, trip counts applied."""
    comps = parse_module(hlo_text)
    entry = next(c for c in comps.values() if c.is_entry)
    collectives: list[Collective] = []
    loops: list[Loop] = []
    totals = {"flops": 0.0, "hbm": 0.0}

    visits = itertools.count()
    async_channels: set[str] = set()  # TPU async chains: later copies anywhere are the same

    def visit(comp: Computation, mult: int, in_loop: bool, fused: bool, depth: int,
              seen: set | None = None) -> None:
        if depth > 64:
            raise ValueError(f"HLO call graph deeper than 64 at {comp.name}")
        if not fused:  # one execution context: a channel id counts once in it
            seen = {next(visits)}
        users = comp.users()
        for instr in comp.instructions.values():
            kind = _kind(instr, users)
            channel = instr.attr("channel_id")
            if kind and channel is not None:
                if channel in seen or channel in async_channels:
                    kind = None
                seen.add(channel)
                if _starts_async(instr, users):
                    async_channels.add(channel)
            if kind:
                collectives.append(Collective(
                    kind, instr.name, comp.name, float(_collective_bytes(kind, instr, comp)), mult,
                    in_loop, instr.shape[-1].dims if instr.shape else (),
                    _gathered(kind, instr, comp, comps)))
            totals["flops"] += mult * dot_flops(instr, comp)
            callees = instr.called()
            if not fused and instr.opcode not in _FREE:
                callee = comps.get(dict(callees).get("calls", "")) if instr.opcode == "fusion" \
                    else None
                totals["hbm"] += mult * _fusion_hbm_bytes(instr, callee, comp)
            if instr.opcode in _DONE:
                continue
            if instr.opcode == "while":
                n, how = trip_count(comps, comp, instr)
                loops.append(Loop(instr.name, comp.name, n, how, mult * n))
                visit(comps[dict(callees)["body"]], mult * n, True, False, depth + 1)
                continue
            for attr, name in callees:
                if attr in ("to_apply", "condition") or name not in comps:
                    continue
                visit(comps[name], mult, in_loop, fused or instr.opcode == "fusion", depth + 1,
                      seen)

    visit(entry, 1, False, False, 0)
    return ProgramCost(collectives, loops, totals["flops"], totals["hbm"])


# ----------------------------------------------------------------------------- roofline


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Roofline estimate of one step: the max of the compute, memory and ICI times."""

    compute_s: float
    memory_s: float
    communication_s: float
    model_flops_per_chip: float
    peak_flops: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s, self.communication_s)

    @property
    def bound(self) -> str:
        terms = {"compute": self.compute_s, "memory": self.memory_s,
                 "communication": self.communication_s}
        return max(terms, key=terms.get)

    @property
    def mfu(self) -> float:
        return self.model_flops_per_chip / (self.step_s * self.peak_flops)


def roofline(cost: ProgramCost, *, peak_flops: float, hbm_bandwidth: float,
             ici_bandwidth: float, model_flops_per_chip: float) -> Estimate:
    """Each term alone at the chip's peak: a lower bound on the step time (no overlap
    penalty), so the MFU is an upper estimate. ICI time = collective bytes per chip over the
    chip's total ICI bandwidth (optimistic for a collective that uses one mesh axis)."""
    return Estimate(cost.flops / peak_flops, cost.hbm_bytes / hbm_bandwidth,
                    cost.collective_bytes / ici_bandwidth, model_flops_per_chip, peak_flops)
