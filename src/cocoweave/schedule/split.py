"""split: an all_reduce becomes a reduce_scatter followed by an all_gather (sum, avg, max, min)."""

from __future__ import annotations

from ..errors import ProgramError, ScheduleError
from ..ir import ops
from ..ir.graph import Program, Value
from .find import find
from .rewrite import named, rebuild


def split_names(all_reduce: str) -> tuple[str, str]:
    """The names split gives the reduce_scatter and the all_gather that replace all_reduce `all_reduce`."""
    return f"{all_reduce}.rs", f"{all_reduce}.ag"


def split(program: Program, ref: str | Value, dim: int = 0,
          shares: tuple[int, ...] | None = None) -> tuple[Program, str, str]:
    """Rewrite all_reduce `ref` as reduce_scatter(dim) + all_gather over the same mesh axis; returns the program
    and the names of the new reduce_scatter and all_gather. `shares` split the scattered parts unevenly."""
    ar = find(program, ref, "all_reduce", "split")
    op = ar.attrs["op"]
    if op == "adasum":
        raise ScheduleError(f"cannot split `{ar.name}`: adasum combines whole tensors (its coefficients "
                            "need every element), so it has no reduce_scatter + all_gather form")
    if ar.ndim == 0:
        raise ScheduleError(f"cannot split `{ar.name}`: a 0-dim tensor has nothing to scatter")
    d = dim + ar.ndim if dim < 0 else dim
    if not 0 <= d < ar.ndim:
        raise ScheduleError(f"cannot split `{ar.name}` along dimension {dim}: it has {ar.ndim} dimensions")
    rs_name, ag_name = split_names(ar.name)

    def hook(v: Value, env: dict[Value, Value], new: Program) -> Value | None:
        if v is not ar:
            return None
        axis = v.attrs.get("axis")
        try:
            rs = ops.reduce_scatter(env[v.args[0]], op, d, axis, shares, v.attrs.get("weights"))
        except ProgramError as e:
            raise ScheduleError(f"cannot split `{ar.name}` along dimension {d}: {getattr(e, 'rule', e)}") from None
        rs = named(rs, rs_name, v.loc)
        return named(ops.all_gather(rs, axis=axis), ag_name, v.loc)

    return rebuild(program, hook), rs_name, ag_name
