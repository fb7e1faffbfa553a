"""Readable text for programs (one line per operation) and a stable fingerprint."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import Program, Value


def operand(v: Value) -> str:
    """How a value is referenced inside an expression."""
    if v.op == "const":
        return repr(v.attrs["value"])
    return v.name


def format_attrs(attrs: dict) -> str:
    parts = []
    for k, val in attrs.items():
        if val is None or k in ("has_weight", "has_bias", "init"):
            continue
        parts.append(f"{k}={val!r}" if isinstance(val, str) and k != "op" else f"{k}={val}")
    return ", ".join(parts)


def format_value(v: Value) -> str:
    """One line: `name = op(operands, attrs)  : type`."""
    if v.op == "input":
        return f"input  {v.name}: {v.type_str()}"
    if v.op == "scalar":
        default = v.attrs.get("default")
        return f"scalar {v.name}: {v.dtype}" + (f" = {default}" if default is not None else "")
    inner = ", ".join([operand(a) for a in v.args] + ([format_attrs(v.attrs)] if format_attrs(v.attrs) else []))
    return f"{v.name} = {v.op}({inner})  : {v.type_str()}"


def format_program(p: Program) -> str:
    """The whole program: header, inputs, operations (constants folded into operands), results."""
    groups = "" if len(p.groups) == 1 else "  groups: " + ", ".join(g.name for g in p.groups)
    if p.groups[0].mesh is not None:
        groups += f"  mesh: {p.groups[0].mesh}"
    lines = [f"program {p.name}{groups}"]
    for v in p.values:
        if v.op != "const":
            lines.append("  " + format_value(v))
    for name, v in p.outputs:
        lines.append(f"  output {name} = {operand(v)}")
    return "\n".join(lines)


def fingerprint(p: Program) -> str:
    """16 hex digits that change whenever the program's meaning or names change."""
    return hashlib.sha256(format_program(p).encode()).hexdigest()[:16]
