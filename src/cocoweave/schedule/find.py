"""Finding values of a program by name or by a stage handle, with errors that list what exists."""

from __future__ import annotations

from ..errors import ScheduleError
from ..ir.graph import Program, Value


def find(program: Program, ref: str | Value, want_op: str | None = None, verb: str = "transform") -> Value:
    """The value named `ref` (or with the same name as the given value)."""
    name = ref.name if isinstance(ref, Value) else getattr(ref, "anchor", ref)
    for v in program.values:
        if v.name == name:
            if want_op and v.op != want_op:
                raise ScheduleError(f"cannot {verb} `{name}`: it is a {v.op}, not an {want_op}")
            return v
    candidates = [v.name for v in program.values if want_op is None or v.op == want_op]
    raise ScheduleError(f"cannot {verb} `{name}`: program `{program.name}` has no such value"
                        + (f"; its {want_op}s are: {', '.join(candidates)}" if want_op and candidates else ""))


def describe(v: Value) -> str:
    """`m1 = add(...)` style reference used in error messages."""
    from ..ir.printer import operand

    return f"{v.name} = {v.op}({', '.join(operand(a) for a in v.args)})"
