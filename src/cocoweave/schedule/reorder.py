"""reorder: computations that consume an all_gather's result and can work on slices move before it.

Given `y = all_gather(x)` with x Sliced(d), the *region* is every elementwise operation, reduction,
update and send that (transitively) reads y, plus the *feeders* whose every user is in the region
(like `beta1 * m` in Adam or `norm(w)` in LAMB). The region is rebuilt on slices:
- Replicated operands from outside are sliced with a local `slice` (no communication);
- a reduction over the sliced dimension gives per-rank partials, so a small all_reduce is inserted
  (norms become sqrt(all_reduce(sum(x * x))));
- an all_gather is inserted for every live-out (a value read by an operation outside the region,
  an output, or the new value of a Replicated state).
Refused: an operation in the region that reads a Local value, and a region with nothing to move.

On a mesh, "sliced", "Replicated" and "Local" are along the all_gather's axis: the region moves onto the
slices of that axis, and the inserted slices, all_gathers and all_reduces run over it.
"""

from __future__ import annotations

from ..errors import ProgramError, ScheduleError
from ..ir import ops
from ..ir import registry as R
from ..ir.graph import Program, Value
from ..ir.layout import Placement
from .find import describe, find
from .rewrite import axis_of, copy_value, named, on_axis, prune

REDUCTIONS = R.names(R.REDUCTION)
FEEDERS = R.names(*R.ELEMENTWISE_GROUPS, R.REDUCTION)  # computations that may join the region
MOVABLE = R.names(*R.ELEMENTWISE_GROUPS, R.REDUCTION, R.STATE, R.P2P)


def _aligned(dim: int, outer: Value, inner: Value) -> int:
    """Dimension of `inner` that lines up with dimension `dim` of `outer` under broadcasting."""
    return dim - (outer.ndim - inner.ndim)


class _Axis:
    """The mesh axis a reorder works along: `at(v)` is tensor v's placement along it."""

    def __init__(self, ag: Value):
        self.index, self.count = axis_of(ag)
        self.name = ag.attrs.get("axis")
        self.shares = on_axis(ag.args[0], self.index, self.count).shares

    def at(self, v: Value) -> Placement:
        return on_axis(v, self.index, self.count)


def _result_dim(v: Value, dims: dict[Value, int | None], red_dim: dict[Value, int], ax: _Axis) -> int | None:
    """Slice dimension of region value v given its operands' (None: a small Replicated result)."""
    if v.op in REDUCTIONS:
        x = v.args[0]
        dx = dims.get(x, red_dim.get(v))
        if dx is None or dx in v.attrs["dims"]:
            return None
        return dx if v.attrs["keepdim"] else dx - len([r for r in v.attrs["dims"] if r < dx])
    if v.op == "update":
        return dims[v.args[1]] if v.args[1] in dims else None
    found = {_aligned(dims[a], v, a) for a in v.args if a in dims and dims[a] is not None}
    found |= {_aligned(ax.at(a).dim, v, a) for a in v.args if a not in dims and not a.is_scalar and ax.at(a).is_sliced}
    if len(found) > 1:
        raise ScheduleError(f"cannot reorder `{describe(v)}`: its operands would be sliced along different "
                            f"dimensions {sorted(found)}")
    return found.pop() if found else None


def find_region(program: Program, ag: Value) -> tuple[dict[Value, int | None], dict[Value, int]]:
    """Region values with their slice dimension, and full reductions pulled in as feeders (with the
    dimension their operand is sliced along)."""
    ax = _Axis(ag)
    dims: dict[Value, int | None] = {ag: ag.attrs["dim"]}
    red_dim: dict[Value, int] = {}
    for v in program.values[ag.id + 1:]:
        if v.op not in MOVABLE or not any(a in dims for a in v.args):
            continue
        for a in v.args:
            if a in dims or a.is_scalar:
                continue
            if ax.at(a).is_local:
                raise ScheduleError(f"cannot reorder `{describe(v)}` before the all_gather `{ag.name}`: "
                                    f"it reads `{a.name}`, which is Local")
        dims[v] = _result_dim(v, dims, red_dim, ax)
    _add_feeders(program, ag, dims, red_dim, ax)
    return dims, red_dim


def _add_feeders(program: Program, ag: Value, dims: dict[Value, int | None], red_dim: dict[Value, int],
                 ax: _Axis) -> None:
    """Pull in computations all of whose users are in the region, until nothing changes."""
    users = program.users()
    changed = True
    while changed:
        changed = False
        for f in reversed(program.values):
            if f in dims or f.is_scalar or f.op not in FEEDERS:
                continue
            us = users[f]
            if not us or any(u not in dims or u.op == "update" for u in us):
                continue
            if any(not a.is_scalar and not ax.at(a).is_replicated for a in f.args) or not ax.at(f).is_replicated:
                continue
            if f.op in REDUCTIONS:
                x = f.args[0]
                j = _aligned(ag.attrs["dim"], ag, x)
                if len(f.attrs["dims"]) != x.ndim or j < 0 or x.shape[j] == 1:
                    continue
                red_dim[f], dims[f] = j, None
                changed = True
                continue
            wants = set()
            for u in us:
                du = red_dim.get(u) if u.op in REDUCTIONS else dims[u]
                if du is None:
                    continue
                j = du if u.op in REDUCTIONS else _aligned(du, u, f)
                if j >= 0 and f.shape[j] != 1:
                    wants.add(j)
            if len(wants) <= 1:
                dims[f] = wants.pop() if wants else None
                changed = True


def reorder(program: Program, ref: str | Value) -> Program:
    """Move the sliceable computation after all_gather `ref` onto slices, before it."""
    ag = find(program, ref, "all_gather", "reorder")
    dims, red_dim = find_region(program, ag)
    if len(dims) == 1:
        consumers = ", ".join(f"`{describe(u)}`" for u in program.users()[ag]) or "nothing"
        raise ScheduleError(f"cannot reorder `{ag.name}`: nothing after it can work on slices (it is read by "
                            f"{consumers})")
    try:
        return _rebuild(program, ag, dims, red_dim)
    except ProgramError as e:
        raise ScheduleError(f"cannot reorder `{ag.name}`: {getattr(e, 'rule', e)}") from None


def _rebuild(program: Program, ag: Value, dims: dict[Value, int | None], red_dim: dict[Value, int]) -> Program:
    ax = _Axis(ag)
    new = program.like()
    env: dict[Value, Value] = {}  # old value -> new value in its original (whole) layout
    sl: dict[Value, Value] = {}  # old region value -> new value in its region (sliced) layout
    cache: dict[tuple[int, int], Value] = {}

    def whole(a: Value) -> Value:
        """The whole (Replicated) form of `a` for readers outside the region: gather live-outs once."""
        if a not in env:
            if a is not ag and ax.at(a).is_sliced:  # sliced in the program as written too: nothing to gather
                env[a] = sl[a]
            else:
                env[a] = named(ops.all_gather(sl[a], axis=ax.name), a.name if a is ag else f"{a.name}.ag", a.loc)
        return env[a]

    def sliced(a: Value, j: int) -> Value:
        key = (id(a), j)
        if key not in cache:
            cache[key] = named(ops.slice(whole(a), j, ax.name, ax.shares), f"{a.name}.s{j}" if j else f"{a.name}.s",
                               a.loc)
        return cache[key]

    def region_operand(v: Value, a: Value) -> Value:
        if a in sl:
            return sl[a]
        if a.is_scalar:
            return env[a]
        j = red_dim.get(v)
        if j is None and dims[v] is not None and v.op != "matmul":
            j = _aligned(dims[v], v, a)
        if j is not None and j >= 0 and a.shape[j] != 1 and ax.at(a).is_replicated:
            return sliced(a, j)
        return whole(a)

    for v in program.values:
        if v is ag:
            sl[v] = env[ag.args[0]]
        elif v in dims:
            sl[v] = _rebuild_region_value(v, [region_operand(v, a) for a in v.args], red_dim, env, ax)
            # whole where its rebuilt layout is: a feeder pulled in after v's dimension was decided (a Replicated
            # operand of v all of whose users are in the region) may have sliced it since
            if not ax.at(sl[v]).is_sliced and v.op != "update":
                env[v] = sl[v]
        else:
            env[v] = copy_value(v, {a: whole(a) for a in v.args}, new)
    for n, v in program.outputs:
        new.output(whole(v) if v in sl else env[v], n)
    return prune(new)


def _rebuild_region_value(v: Value, args: list[Value], red_dim: dict[Value, int], env: dict[Value, Value],
                          ax: _Axis) -> Value:
    """Build v on slices: reductions over the sliced dim get an all_reduce; updates of Replicated state
    get an all_gather (and region readers of the update keep using the sliced value)."""
    if v.op == "update":
        state, value = env[v.args[0]], args[1]
        if ax.at(value).is_sliced and not ax.at(state).is_sliced:
            gathered = named(ops.all_gather(value, axis=ax.name), f"{v.args[0].name}.ag", v.loc)
            env[v] = named(ops.update(state, gathered), v.name, v.loc)
        else:
            env[v] = named(ops.update(state, value), v.name, v.loc)
        return value
    if v.op in REDUCTIONS and ax.at(args[0]).is_sliced and ax.at(args[0]).dim in v.attrs["dims"]:
        return _partial_then_all_reduce(v, args[0], ax.name)
    new = next(a.program for a in args if not a.is_scalar)
    return named(R.rebuild(new, v.op, args, v.attrs), v.name, v.loc)


def _partial_then_all_reduce(v: Value, x: Value, axis: str | None) -> Value:
    """A reduction over the sliced dimension: reduce the slice, then all_reduce the partials."""
    d, k, n = v.attrs["dims"], v.attrs["keepdim"], v.name
    if v.op == "norm":
        xf = named(ops.cast(x, "float32"), f"{n}.f32", v.loc) if x.dtype in ("float16", "bfloat16") else x
        sq = named(ops.sum(named(xf * xf, f"{n}.x2", v.loc), d, k), f"{n}.sq", v.loc)
        total = named(ops.all_reduce(sq, "sum", axis), f"{n}.ar", v.loc)
        if v.dtype == total.dtype:
            return named(ops.sqrt(total), n, v.loc)
        return named(ops.cast(named(ops.sqrt(total), f"{n}.sqrt", v.loc), v.dtype), n, v.loc)
    part = named(getattr(ops, v.op)(x, d, k), f"{n}.part", v.loc)
    return named(ops.all_reduce(part, v.op, axis), n, v.loc)
