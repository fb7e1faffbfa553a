"""as_slice: a state tensor used only in sliced form is stored sliced (1/p of the memory); the
all_gather that rebuilt it whole after its update becomes dead and disappears."""

from __future__ import annotations

from ..errors import ScheduleError
from ..ir import ops
from ..ir.graph import Program, Value
from .find import describe
from .rewrite import copy_value, named, prune


def sliced_dim(program: Program, name: str) -> int:
    """The dimension along which every use of input `name` slices it; ScheduleError if one does not."""
    t = program.inputs.get(name)
    if t is None or t.op != "input":
        raise ScheduleError(f"cannot store `{name}` sliced: program `{program.name}` has no tensor input `{name}`")
    if not t.layout.is_replicated:
        raise ScheduleError(f"cannot store `{name}` sliced: it is {t.layout!r}, only Replicated tensors can be")
    dims = set()
    for u in program.users()[t]:
        if u.op == "slice":
            dims.add(u.attrs["dim"])
        elif u.op == "update" and u.args[0] is t:
            val = u.args[1]
            if val.op != "all_gather":
                raise ScheduleError(f"cannot store `{name}` sliced: its new value `{val.name}` is computed whole "
                                    "(split and reorder its all_reduce first)")
            dims.add(val.attrs["dim"])
        else:
            raise ScheduleError(f"cannot store `{name}` sliced: `{describe(u)}` reads it whole")
    for out_name, v in program.outputs:
        if v is t:
            raise ScheduleError(f"cannot store `{name}` sliced: it is the program's output `{out_name}`")
    if len(dims) != 1:
        raise ScheduleError(f"cannot store `{name}` sliced: it is " +
                            ("never used in sliced form" if not dims else f"sliced along several dims {sorted(dims)}"))
    return dims.pop()


def as_slice(program: Program, name: str) -> Program:
    """Store input `name` Sliced along the dimension its uses slice it."""
    d = sliced_dim(program, name)
    t = program.inputs[name]
    new = Program(program.name)
    if len(program.groups) > 1:
        new.pipeline(len(program.groups))
    env: dict[Value, Value] = {}
    for v in program.values:
        if v is t:
            env[v] = copy_value(v, env, new, layout=ops.Sliced(d))
        elif v.op == "slice" and v.args[0] is t:
            env[v] = env[t]
        elif v.op == "update" and v.args[0] is t:
            env[v] = named(ops.update(env[t], env[v.args[1].args[0]]), v.name, v.loc)
        else:
            env[v] = copy_value(v, env, new)
    for n, v in program.outputs:
        new.output(env[v], n)
    return prune(new)
