"""A small parser for compiled (post-optimisation) HLO text: computations, instructions,
shapes and the call graph, which is all the communication / roofline report needs.

Why not XLA's cost analysis: it visits a while loop's body once, so a scanned ODE (or a
scanned layer stack) is undercounted by its trip count. Here every computation gets a
multiplicity (how often one run of the entry executes it), with while bodies multiplied by
their trip count, recursively.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of each HLO primitive type (sub-byte types rounded as XLA packs them).
DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP_ATTR = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


@dataclasses.dataclass
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)


def parse_shape(text: str) -> list[Array]:
    """Every array in a (possibly tuple) HLO shape, layouts and comments ignored."""
    text = re.sub(r"\{[^{}]*\}", "", re.sub(r"/\*.*?\*/", "", text))
    return [Array(m[1], tuple(int(d) for d in m[2].split(",") if d))
            for m in _ARRAY.finditer(text) if m[1] in DTYPE_BYTES]


def shape_bytes(arrays: list[Array]) -> float:
    return sum(a.bytes for a in arrays)


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: list[Array]
    operands: list[str]
    attrs: str  # everything after the operand list
    is_root: bool = False

    def called(self) -> list[tuple[str, str]]:
        """(attribute, computation) pairs this instruction calls."""
        out = [(m[1], m[2]) for m in _COMP_ATTR.finditer(self.attrs)]
        if m := _BRANCHES.search(self.attrs):
            out += [("branch", c.strip().lstrip("%")) for c in m[1].split(",") if c.strip()]
        return out

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|\"[^\"]*\"|[^,\s]+)", self.attrs)
        return m[1].strip('"') if m else None


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    is_entry: bool = False

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.is_root)

    def users(self) -> dict[str, list[Instruction]]:
        out: dict[str, list[Instruction]] = {}
        for instr in self.instructions.values():
            for op in instr.operands:
                out.setdefault(op, []).append(instr)
        return out


def _split_balanced(text: str) -> tuple[str, str]:
    """text starts with '(': (inside, rest after the matching ')')."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[1:i], text[i + 1:]
    return text[1:], ""


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m[1]), m[2], m[3]
    if rest.startswith("("):  # tuple shape
        inner, rest = _split_balanced(rest)
        shape_text = "(" + inner + ")"
    else:
        shape_text, _, rest = rest.partition(" ")
    rest = rest.lstrip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om[1]
    inside, attrs = _split_balanced(rest[len(opcode):])
    operands = re.findall(r"%([\w.\-]+)", re.sub(r"/\*.*?\*/", "", inside))
    if opcode in ("constant", "parameter"):
        attrs = inside + attrs  # keep the literal / parameter number readable
    return Instruction(name, opcode, parse_shape(shape_text), operands, attrs.lstrip(", "),
                       is_root)


def parse_module(text: str) -> dict[str, Computation]:
    """Computations of an HLO module text by name (the entry flagged ``is_entry``)."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            if m := _HEADER.match(line):
                current = Computation(m[2], {}, is_entry=bool(m[1]))
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        if instr := _parse_instruction(line):
            current.instructions[instr.name] = instr
    if not any(c.is_entry for c in comps.values()):
        raise ValueError("HLO text has no ENTRY computation")
    return comps


# ------------------------------------------------------------------------- while loops


def _constant_int(comp: Computation, name: str, depth: int = 0) -> int | None:
    """The integer value of `name` if it is a scalar constant (through copies/converts)."""
    instr = comp.instructions.get(name)
    if instr is None or depth > 8:
        return None
    if instr.opcode == "constant":
        m = re.match(r"\s*(-?\d+)\s*\)?", instr.attrs)
        return int(m[1]) if m and not instr.shape[0].dims else None
    if instr.opcode in ("copy", "convert", "bitcast", "reshape") and instr.operands:
        return _constant_int(comp, instr.operands[0], depth + 1)
    return None


def _tuple_element(comp: Computation, name: str, index: int) -> str | None:
    instr = comp.instructions.get(name)
    if instr is None:
        return None
    if instr.opcode == "tuple" and index < len(instr.operands):
        return instr.operands[index]
    if instr.opcode == "copy" and instr.operands:
        return _tuple_element(comp, instr.operands[0], index)
    return None


def _gte_index(comp: Computation, name: str) -> int | None:
    instr = comp.instructions.get(name)
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast"):
        instr = comp.instructions.get(instr.operands[0])
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    m = re.search(r"index=(\d+)", instr.attrs)
    return int(m[1]) if m else None


def trip_count(comps: dict[str, Computation], caller: Computation,
               loop: Instruction) -> tuple[int, str]:
    """(trip count, how it was found) of a while instruction.

    XLA's ``known_trip_count`` backend annotation when present; otherwise the induction
    variable: ``compare(gte(param, i), constant L)`` in the condition, the init value of
    tuple element i in the caller and the constant added to it in the body.
    """
    if m := re.search(r'"known_trip_count":\{"n":"?(\d+)', loop.attrs):
        return int(m[1]), "known_trip_count"
    attrs = dict(loop.called())
    cond, body = comps[attrs["condition"]], comps[attrs["body"]]
    cmp = cond.root
    while cmp.opcode in ("copy", "convert") and cmp.operands:
        cmp = cond.instructions[cmp.operands[0]]
    if cmp.opcode != "compare" or len(cmp.operands) != 2:
        raise ValueError(f"while {loop.name}: condition root is {cmp.opcode}, not a compare")
    direction = (re.search(r"direction=(\w+)", cmp.attrs) or [None, "LT"])[1]
    lhs, rhs = cmp.operands
    index, limit = _gte_index(cond, lhs), _constant_int(cond, rhs)
    if index is None or limit is None:  # constant on the left: L > i  <=>  i < L
        index, limit = _gte_index(cond, rhs), _constant_int(cond, lhs)
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if index is None or limit is None:
        raise ValueError(f"while {loop.name}: no induction variable against a constant")
    init_name = _tuple_element(caller, loop.operands[0], index)
    init = _constant_int(caller, init_name) if init_name else None
    step = None
    nxt = _tuple_element(body, body.root.name, index)
    if nxt and (add := body.instructions.get(nxt)) is not None and add.opcode == "add":
        for a, b in (add.operands, add.operands[::-1]):
            if _gte_index(body, a) == index and (c := _constant_int(body, b)) is not None:
                step = c
    how = "loop condition"
    if init is None:
        init, how = 0, how + " (init assumed 0)"
    if not step:
        step, how = 1, how + " (step assumed 1)"
    span = {"LT": limit - init, "LE": limit - init + 1, "NE": limit - init}.get(direction)
    if direction in ("GT", "GE"):
        span = init - limit + (direction == "GE")
        step = -step
    if span is None:
        raise ValueError(f"while {loop.name}: unsupported compare direction {direction}")
    return max(0, math.ceil(span / abs(step))), how
