"""as_slice: a state tensor used only in sliced form is stored sliced (1/p of the memory); the
all_gather that rebuilt it whole after its update becomes dead and disappears. On a mesh, the state is
stored sliced along the axis its uses slice it over (its layout along the other axes is kept)."""

from __future__ import annotations

from ..errors import ScheduleError
from ..ir import ops
from ..ir.graph import Program, Value
from ..ir.layout import Sliced
from .find import describe
from .rewrite import axis_of, copy_value, named, on_axis, prune, with_placement


def sliced_dim(program: Program, name: str) -> int:
    """The dimension along which every use of input `name` slices it; ScheduleError if one does not."""
    return sliced_as(program, name)[0]


def sliced_as(program: Program, name: str) -> tuple[int, str | None, tuple[int, ...] | None]:
    """(dimension, mesh axis, shares) with which every use of input `name` slices it; ScheduleError if the uses
    disagree or one reads it whole."""
    t = program.inputs.get(name)
    if t is None or t.op != "input":
        raise ScheduleError(f"cannot store `{name}` sliced: program `{program.name}` has no tensor input `{name}`")
    if not _replicated_along(t, None):
        raise ScheduleError(f"cannot store `{name}` sliced: it is {t.layout!r}, only Replicated tensors can be")
    ways = set()
    for u in program.users()[t]:
        if u.op == "slice":
            ways.add((u.attrs["dim"], u.attrs.get("axis"), u.attrs.get("shares")))
        elif u.op == "update" and u.args[0] is t:
            val = u.args[1]
            if val.op != "all_gather":
                raise ScheduleError(f"cannot store `{name}` sliced: its new value `{val.name}` is computed whole "
                                    "(split and reorder its all_reduce first)")
            i, n = axis_of(val)
            ways.add((val.attrs["dim"], val.attrs.get("axis"), on_axis(val.args[0], i, n).shares))
        else:
            raise ScheduleError(f"cannot store `{name}` sliced: `{describe(u)}` reads it whole")
    for out_name, v in program.outputs:
        if v is t:
            raise ScheduleError(f"cannot store `{name}` sliced: it is the program's output `{out_name}`")
    if len(ways) != 1:
        how = "never used in sliced form" if not ways else f"sliced in several ways {sorted(ways, key=str)}"
        raise ScheduleError(f"cannot store `{name}` sliced: it is {how}")
    way = ways.pop()
    if not _replicated_along(t, way[1]):
        raise ScheduleError(f"cannot store `{name}` sliced: it is {t.layout!r}, not Replicated along axis `{way[1]}`")
    return way


def _replicated_along(t: Value, axis: str | None) -> bool:
    """Whether t is Replicated along mesh axis `axis` (None: along some axis)."""
    mesh = t.group.mesh
    if mesh is None or len(mesh.axes) == 1:
        return t.layout.is_replicated
    if axis is None:
        return any(on_axis(t, i, len(mesh.axes)).is_replicated for i in range(len(mesh.axes)))
    return on_axis(t, mesh.index(axis), len(mesh.axes)).is_replicated


def as_slice(program: Program, name: str) -> Program:
    """Store input `name` Sliced along the dimension (and mesh axis) its uses slice it."""
    d, axis, shares = sliced_as(program, name)
    t = program.inputs[name]
    mesh = t.group.mesh
    i, n = (mesh.index(axis), len(mesh.axes)) if mesh is not None and len(mesh.axes) > 1 else (0, 1)
    new = program.like()
    env: dict[Value, Value] = {}
    for v in program.values:
        if v is t:
            env[v] = copy_value(v, env, new, layout=with_placement(t, i, n, Sliced(d, shares)))
        elif v.op == "slice" and v.args[0] is t:
            env[v] = env[t]
        elif v.op == "update" and v.args[0] is t:
            env[v] = named(ops.update(env[t], env[v.args[1].args[0]]), v.name, v.loc)
        else:
            env[v] = copy_value(v, env, new)
    for n_, v in program.outputs:
        new.output(env[v], n_)
    return prune(new)
