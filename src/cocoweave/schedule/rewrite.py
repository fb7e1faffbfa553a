"""Rebuilding programs: the one mechanism every graph rewrite (split, reorder, as_slice) uses.

A rewrite walks the old program in order and, for each value, either lets it be copied (through
the DSL's checked constructors, so layouts are inferred and checked again) or builds replacement
values itself. Every copied value keeps its name and location, so names are stable handles across
rewrites; values a rewrite creates get names derived from the value they came from (`%9.rs`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir import ops, registry
from ..ir.graph import Program, Value, make_layout
from ..ir.layout import Layout, Placement, placements

# (old value, mapping of old values to new ones, new program) -> new value, or None to copy as is
Hook = Callable[[Value, dict[Value, Value], Program], Value | None]


def copy_value(v: Value, env: dict[Value, Value], new: Program, layout: Layout | None = None) -> Value:
    """Copy one value into `new` with its operands mapped through `env`."""
    if v.op == "input":
        group = next(g for g in new.groups if g.name == v.group.name)
        return named(new.tensor(v.name, v.shape, v.dtype, layout or v.layout, group, v.attrs["init"]), v.name, v.loc)
    if v.op == "scalar":
        out = new.scalar(v.name, v.dtype, v.attrs["default"])
    elif v.op == "const":
        out = ops.lift(v.attrs["value"], new)
    else:
        out = registry.rebuild(new, v.op, [env[a] for a in v.args], v.attrs)
    return named(out, v.name, v.loc)


def axis_of(v: Value) -> tuple[int, int]:
    """(index of the mesh axis communication value v runs over, number of axes) (0 of 1 without a mesh)."""
    mesh = v.group.mesh
    if mesh is None or len(mesh.axes) == 1:
        return 0, 1
    return mesh.index(v.attrs["axis"]), len(mesh.axes)


def on_axis(v: Value, axis: int, n: int) -> Placement:
    """The placement of tensor v along mesh axis number `axis` of `n`."""
    return placements(v.layout, n)[axis]


def with_placement(v: Value, axis: int, n: int, p: Placement) -> Layout:
    """v's layout with placement `p` along mesh axis number `axis` of `n`."""
    per = list(placements(v.layout, n))
    per[axis] = p
    return make_layout(v.group, per)


def named(v: Value, name: str, loc: str | None = None) -> Value:
    """Give a rewrite-created value a stable name (and the location of the value it came from)."""
    v.name = name
    if loc is not None:
        v.loc = loc
    return v


def rebuild(old: Program, hook: Hook | None = None) -> Program:
    """A new program equal to `old` except where `hook` builds replacements, without dead values."""
    new = old.like()
    env: dict[Value, Value] = {}
    for v in old.values:
        out = hook(v, env, new) if hook else None
        env[v] = out if out is not None else copy_value(v, env, new)
    for name, v in old.outputs:
        new.output(env[v], name)
    return prune(new)


def prune(p: Program) -> Program:
    """Drop values no result depends on (dead all_gathers after as_slice, unused constants)."""
    live: set[int] = set()
    stack = [v for _, v in p.outputs] + list(p.updates.values()) + list(p.inputs.values())
    while stack:
        v = stack.pop()
        if id(v) in live:
            continue
        live.add(id(v))
        stack.extend(v.args)
    if len(live) == len(p.values):
        return _unique_names(p)
    new = p.like()
    env: dict[Value, Value] = {}
    for v in p.values:
        if id(v) in live:
            env[v] = copy_value(v, env, new)
    for name, v in p.outputs:
        new.output(env[v], name)
    return _unique_names(new)


def _unique_names(p: Program) -> Program:
    """Names are handles: a rewrite that produced two values with one name is a bug, caught here."""
    seen: set[str] = set()
    for v in p.values:
        if v.op != "const" and v.name in seen:
            raise AssertionError(f"rewrite produced two values named {v.name!r} in program {p.name!r}")
        seen.add(v.name)
    return p
