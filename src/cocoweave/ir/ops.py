"""DSL operations. Each checks its operands and infers dtype, shape, layout and group.

A rule violation raises `ProgramError` naming the operation, where it was written, its operands
(with layouts and shapes) and the rule that failed.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import CollectiveKind, register_kind
from ..errors import InputError, ProgramError
from . import registry as R
from .graph import Group, Program, Value, make_layout, user_location
from .layout import Layout, Local, Placement, Replicated, Sliced, check_shares, placements, split_sizes
from .types import Shape, bind_shape, broadcast_shapes, canonical_dtype, is_float, promote

REDUCE_OPS = ("sum", "avg", "max", "min", "adasum")  # how a collective combines the ranks' tensors


def operation(name: str, group: str, attrs: Sequence[str] = (), rebuild: R.Rebuild | None = None,
              draw: Any = None):
    """Register the decorated DSL function as operation `name` of `group` (registry.py). By default a
    rewrite rebuilds it by calling the function on the new operands."""

    def wrap(fn):
        R.register(name, group, attrs, fn, rebuild or (lambda program, args, a: fn(*args)), draw)
        return fn

    return wrap


def _fail(op: str, operands: Sequence[Value], rule: str) -> ProgramError:
    where = next((v.loc for v in operands if v.loc), None)
    loc = _caller_loc()
    args = ", ".join(v.describe() for v in operands)
    err = ProgramError(f"{loc or where or '?'}: {op}({args}): {rule}")
    err.rule = rule  # the rule alone, for rewrites that explain why they cannot apply
    return err


def _caller_loc() -> str | None:
    return user_location()


def _program_of(*xs: Any) -> Program:
    for x in xs:
        if isinstance(x, Value):
            return x.program
    raise ProgramError("an operation needs at least one program value among its operands")


def lift(x: Any, program: Program) -> Value:
    """Python numbers become constants; values of another program are refused."""
    if isinstance(x, Value):
        if x.program is not program:
            raise ProgramError(f"`{x.name}` belongs to program `{x.program.name}`, not `{program.name}`")
        return x
    if isinstance(x, bool):
        return program._add("const", (), {"value": x}, "bool", (), Replicated, None)
    if isinstance(x, int | float):
        return program._add("const", (), {"value": float(x) if isinstance(x, float) else x},
                            "float32" if isinstance(x, float) else "int64", (), Replicated, None)
    raise ProgramError(f"cannot use {type(x).__name__} {x!r} as a program value")


def _common_group(op: str, vals: Sequence[Value]) -> Group | None:
    groups = {v.group for v in vals if v.group is not None}
    if len(groups) > 1:
        raise _fail(op, vals, "operands live on different process groups; move data with cw.send first")
    return next(iter(groups), None)


def _result_dtype(vals: Sequence[Value]) -> str:
    """torch-like promotion where scalars and constants do not widen tensors (weak types)."""
    tensors = [v for v in vals if not v.is_scalar]
    pool = tensors or list(vals)
    dtype = pool[0].dtype
    for v in pool[1:]:
        dtype = promote(dtype, v.dtype)
    if tensors and not is_float(dtype) and any(is_float(v.dtype) for v in vals if v.is_scalar):
        dtype = "float32"
    if not tensors and all(v.op == "const" for v in vals) and dtype == "int64":
        dtype = "int64"
    return dtype


def _axes(group: Group | None) -> tuple[str | None, ...]:
    """The mesh axes of `group` (Group.axes; one unnamed axis without a group)."""
    return group.axes if group is not None else (None,)


def _at(v: Value, i: int, n: int) -> Placement:
    """The placement of `v` along axis `i` of `n`."""
    return placements(v.layout, n)[i]


def _along(axis: str | None) -> str:
    return "" if axis is None else f" along axis `{axis}`"


def elementwise_layout(op: str, vals: Sequence[Value], shape: Shape) -> Layout:
    """Layout rule for elementwise operations (DESIGN.md), per mesh axis: equal layouts propagate, Replicated
    with X gives X, Sliced(a) with Sliced(b) (a != b) and Local with Sliced are errors."""
    group = next((v.group for v in vals if v.group is not None), None)
    axes = _axes(group)
    per = [_elementwise_placement(op, vals, shape, i, axes) for i in range(len(axes))]
    if len(axes) > 1:
        _check_nesting(op, vals, shape, per, axes)
    return make_layout(group, per)


def _elementwise_placement(op: str, vals: Sequence[Value], shape: Shape, i: int,
                           axes: tuple[str | None, ...]) -> Placement:
    tensors = [v for v in vals if not v.is_scalar]
    at = {v: _at(v, i, len(axes)) for v in tensors}
    on = _along(axes[i])
    if any(p.is_local for p in at.values()) and any(p.is_sliced for p in at.values()):
        raise _fail(op, vals, f"a Local operand cannot combine with a Sliced one{on} (reduce the Local one first)")
    dims = {}
    for v in tensors:
        if at[v].is_sliced:
            dims[at[v].dim + len(shape) - v.ndim] = v
    if len(dims) > 1:
        a, b = sorted(dims)
        raise _fail(op, vals, f"operands are sliced along different dimensions ({a} and {b} of the result){on}; "
                              "elementwise operands must be sliced along the same dimension")
    if dims:
        (d, _), = dims.items()
        for v in tensors:
            j = d - (len(shape) - v.ndim)
            if at[v].is_sliced and v.shape[j] != shape[d]:
                raise _fail(op, vals, f"`{v.name}` is sliced along dimension {j}, which is broadcast; "
                                      "a sliced dimension cannot be broadcast")
        shares = {at[v].shares for v in tensors if at[v].is_sliced}
        if len(shares) > 1:
            raise _fail(op, vals, f"operands are sliced along dimension {d}{on} in different shares "
                                  f"({' and '.join(map(str, shares))}); elementwise operands must be sliced alike")
        return Sliced(d, shares.pop())
    if any(p.is_local for p in at.values()):
        return Local
    return Replicated


def _check_nesting(op: str, vals: Sequence[Value], shape: Shape, per: list[Placement],
                   axes: tuple[str | None, ...]) -> None:
    """An operand cut to the result's part along an axis must not already be sliced along that dimension by a
    later axis: dimensions sliced by several axes nest in mesh order, the first axis outermost."""
    for v in (v for v in vals if not v.is_scalar):
        mine = placements(v.layout, len(axes))
        for i, p in enumerate(per):
            if not p.is_sliced or not mine[i].is_replicated:
                continue
            j = p.dim - (len(shape) - v.ndim)
            if j < 0 or v.shape[j] == 1:
                continue
            later = [axes[k] for k in range(i + 1, len(axes)) if mine[k].is_sliced and mine[k].dim == j]
            if later:
                raise _fail(op, vals, f"`{v.name}` is sliced along dimension {j} by axis `{later[0]}` but not by "
                                      f"axis `{axes[i]}` before it, so its part along `{axes[i]}` cannot be cut "
                                      "(a dimension sliced by several axes is split in mesh order)")


def _elementwise(op: str, operands: Sequence[Any], attrs: dict | None = None, dtype: str | None = None) -> Value:
    program = _program_of(*operands)
    vals = [lift(x, program) for x in operands]
    shape = broadcast_shapes([v.shape for v in vals])
    if shape is None:
        raise _fail(op, vals, "shapes do not broadcast")
    group = _common_group(op, vals)
    layout = elementwise_layout(op, vals, shape)
    out_dtype = dtype or _result_dtype(vals)
    return program._add(op, tuple(vals), attrs or {}, out_dtype, shape, layout, group)


def _float_only(op: str, vals: Sequence[Value]) -> None:
    for v in vals:
        if not v.is_scalar and not is_float(v.dtype):
            raise _fail(op, vals, f"needs floating-point operands, `{v.name}` is {v.dtype}")


# -- elementwise arithmetic -------------------------------------------------------------------
@operation("add", R.BINARY)
def add(a: Any, b: Any) -> Value:
    """a + b with broadcasting."""
    return _elementwise("add", (a, b))


@operation("sub", R.BINARY)
def sub(a: Any, b: Any) -> Value:
    """a - b with broadcasting."""
    return _elementwise("sub", (a, b))


@operation("mul", R.BINARY)
def mul(a: Any, b: Any) -> Value:
    """a * b with broadcasting."""
    return _elementwise("mul", (a, b))


@operation("div", R.BINARY)
def div(a: Any, b: Any) -> Value:
    """a / b (true division; integer operands give float32)."""
    return _float_binary("div", a, b)


def _float_binary(op: str, a: Any, b: Any) -> Value:
    """A binary op whose result is a float: the operands' promoted dtype, or float32 for integers."""
    program = _program_of(a, b)
    vals = [lift(x, program) for x in (a, b)]
    dtype = _result_dtype(vals)
    return _elementwise(op, vals, dtype=dtype if is_float(dtype) else "float32")


@operation("pow", R.BINARY)
def pow(a: Any, b: Any) -> Value:  # noqa: A001 - the DSL's name
    """a ** b."""
    return _elementwise("pow", (a, b))


@operation("maximum", R.BINARY)
def maximum(a: Any, b: Any) -> Value:
    """Elementwise maximum."""
    return _elementwise("maximum", (a, b))


@operation("minimum", R.BINARY)
def minimum(a: Any, b: Any) -> Value:
    """Elementwise minimum."""
    return _elementwise("minimum", (a, b))


@operation("neg", R.UNARY)
def neg(x: Value) -> Value:
    """-x."""
    return _elementwise("neg", (x,))


@operation("abs", R.UNARY)
def abs(x: Value) -> Value:  # noqa: A001 - the DSL's name
    """|x|."""
    return _elementwise("abs", (x,))


def _float_unary(op: str, x: Value) -> Value:
    v = lift(x, _program_of(x))
    dtype = v.dtype if is_float(v.dtype) else "float32"
    return _elementwise(op, (v,), dtype=dtype)


@operation("sqrt", R.UNARY)
def sqrt(x: Value) -> Value:
    """Square root."""
    return _float_unary("sqrt", x)


@operation("rsqrt", R.UNARY)
def rsqrt(x: Value) -> Value:
    """1 / sqrt(x)."""
    return _float_unary("rsqrt", x)


@operation("exp", R.UNARY)
def exp(x: Value) -> Value:
    """e ** x."""
    return _float_unary("exp", x)


@operation("sigmoid", R.UNARY)
def sigmoid(x: Value) -> Value:
    """1 / (1 + e ** -x): one operation where neg, exp, add and div would be four passes."""
    return _float_unary("sigmoid", x)


@operation("silu", R.UNARY)
def silu(x: Value) -> Value:
    """x / (1 + e ** -x) (x * sigmoid(x)): SwiGLU's activation in one pass instead of four."""
    return _float_unary("silu", x)


@operation("silu_grad", R.BINARY)
def silu_grad(dy: Any, x: Any) -> Value:
    """dy * silu'(x) = dy s (1 + x (1 - s)) with s = sigmoid(x) (torch's silu_backward): SwiGLU's backward through
    its activation in one pass where sigmoid and arithmetic take six (docs/moe.md, "program path")."""
    return _float_binary("silu_grad", dy, x)


@operation("cast", R.CAST, ("dtype",), rebuild=lambda p, args, a: cast(args[0], a["dtype"]))
def cast(x: Value, dtype: str) -> Value:
    """Convert to `dtype` (e.g. fp32 master weights to bf16)."""
    try:
        dtype = canonical_dtype(dtype)
    except ValueError as e:
        raise _fail("cast", (x,), str(e)) from None
    return _elementwise("cast", (x,), {"dtype": dtype}, dtype=dtype)


def _compare(op: str, a: Any, b: Any) -> Value:
    return _elementwise(op, (a, b), dtype="bool")


@operation("lt", R.COMPARISON)
def lt(a: Any, b: Any) -> Value:
    """a < b (bool)."""
    return _compare("lt", a, b)


@operation("le", R.COMPARISON)
def le(a: Any, b: Any) -> Value:
    """a <= b (bool)."""
    return _compare("le", a, b)


@operation("gt", R.COMPARISON)
def gt(a: Any, b: Any) -> Value:
    """a > b (bool)."""
    return _compare("gt", a, b)


@operation("ge", R.COMPARISON)
def ge(a: Any, b: Any) -> Value:
    """a >= b (bool)."""
    return _compare("ge", a, b)


@operation("eq", R.COMPARISON)
def eq(a: Any, b: Any) -> Value:
    """a == b (bool); a function because `==` on values keeps Python's identity meaning."""
    return _compare("eq", a, b)


@operation("ne", R.COMPARISON)
def ne(a: Any, b: Any) -> Value:
    """a != b (bool)."""
    return _compare("ne", a, b)


@operation("where", R.SELECT)
def where(cond: Any, a: Any, b: Any) -> Value:
    """Elementwise choice: a where cond holds, else b."""
    program = _program_of(cond, a, b)
    vals = [lift(x, program) for x in (cond, a, b)]
    if vals[0].dtype != "bool":
        raise _fail("where", vals, f"the condition must be bool, `{vals[0].name}` is {vals[0].dtype}")
    return _elementwise("where", vals, dtype=_result_dtype(vals[1:]))


@operation("dropout", R.RANDOM, ("p", "seed", "offset"),
           rebuild=lambda p, args, a: dropout(args[0], a["p"], a["seed"] if a["seed"] is not None else args[1],
                                              args[2] if a.get("offset") else None))
def dropout(x: Value, p: float, seed: int | Value = 0, offset: Value | None = None) -> Value:
    """Zero each element with probability p, scale the rest by 1/(1-p). The mask depends only on
    (seed, the element's index in the logical tensor) and, for Local tensors, the rank. `offset`, a runtime
    integer scalar (with a runtime seed), is added to every index: the tensor is a part of a larger logical one
    that starts there (a micro-batch of a batch)."""
    program = _program_of(x)
    x = lift(x, program)
    if not isinstance(p, int | float) or not 0.0 <= float(p) < 1.0:
        raise _fail("dropout", (x,), f"the probability must be a number in [0, 1), got {p!r}")
    _float_only("dropout", (x,))
    if x.is_scalar:
        raise _fail("dropout", (x,), "needs a tensor operand")
    if offset is not None and (not isinstance(offset, Value) or not isinstance(seed, Value) or
                               not offset.is_scalar or offset.dtype not in ("int32", "int64")):
        raise _fail("dropout", (x,), "the index offset must be a runtime integer scalar, with a runtime seed")
    if isinstance(seed, Value):
        if not seed.is_scalar or seed.dtype not in ("int32", "int64", "float32"):
            raise _fail("dropout", (x, seed), "the seed must be an int or a runtime scalar")
        args, attrs = ((x, seed), {}) if offset is None else ((x, seed, offset), {"offset": True})
        return program._add("dropout", args, {"p": float(p), "seed": None, **attrs}, x.dtype, x.shape, x.layout,
                            x.group)
    if not isinstance(seed, int):
        raise _fail("dropout", (x,), f"the seed must be an int or a runtime scalar, got {seed!r}")
    return program._add("dropout", (x,), {"p": float(p), "seed": seed}, x.dtype, x.shape, x.layout, x.group)


# -- reductions -------------------------------------------------------------------------------
def _norm_dims(op: str, x: Value, dim: int | Sequence[int] | None) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = []
    for d in dims:
        dd = d + x.ndim if d < 0 else d
        if not 0 <= dd < x.ndim:
            raise _fail(op, (x,), f"dimension {d} is out of range for a {x.ndim}-dim tensor")
        out.append(dd)
    if len(set(out)) != len(out):
        raise _fail(op, (x,), f"dimensions {dims} repeat")
    return tuple(sorted(out))


def reduction_layout(x: Value, dims: tuple[int, ...], keepdim: bool) -> Layout:
    """Per mesh axis: a reduction over a sliced dimension gives a per-rank (Local) partial; otherwise the
    layout follows the remaining dimensions."""
    axes = _axes(x.group)
    per = []
    for i in range(len(axes)):
        p = _at(x, i, len(axes))
        if p.is_sliced:
            d = p.dim
            p = Local if d in dims else Sliced(d if keepdim else d - builtins.sum(1 for r in dims if r < d), p.shares)
        per.append(p)
    return make_layout(x.group, per)


def _reduce(op: str, x: Value, dim: int | Sequence[int] | None, keepdim: bool) -> Value:
    x = lift(x, _program_of(x))
    if x.is_scalar:
        raise _fail(op, (x,), "needs a tensor operand")
    dims = _norm_dims(op, x, dim)
    shape = tuple((1 if i in dims else s) for i, s in enumerate(x.shape) if keepdim or i not in dims)
    dtype = x.dtype if op != "norm" or is_float(x.dtype) else "float32"
    if op == "norm":
        _float_only(op, (x,))
    return x.program._add(op, (x,), {"dims": dims, "keepdim": keepdim}, dtype, shape,
                          reduction_layout(x, dims, keepdim), x.group)


@operation("sum", R.REDUCTION, ("dims", "keepdim"), rebuild=lambda p, args, a: sum(args[0], a["dims"], a["keepdim"]))
def sum(x: Value, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Value:  # noqa: A001
    """Sum over `dim` (all dims by default)."""
    return _reduce("sum", x, dim, keepdim)


@operation("max", R.REDUCTION, ("dims", "keepdim"), rebuild=lambda p, args, a: max(args[0], a["dims"], a["keepdim"]))
def max(x: Value, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Value:  # noqa: A001
    """Maximum over `dim` (all dims by default)."""
    return _reduce("max", x, dim, keepdim)


@operation("min", R.REDUCTION, ("dims", "keepdim"), rebuild=lambda p, args, a: min(args[0], a["dims"], a["keepdim"]))
def min(x: Value, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Value:  # noqa: A001
    """Minimum over `dim` (all dims by default)."""
    return _reduce("min", x, dim, keepdim)


@operation("norm", R.REDUCTION, ("dims", "keepdim"), rebuild=lambda p, args, a: norm(args[0], a["dims"], a["keepdim"]))
def norm(x: Value, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Value:
    """Euclidean norm over `dim` (all dims by default), accumulated in float32 or wider."""
    return _reduce("norm", x, dim, keepdim)


# -- matmul and layer norm --------------------------------------------------------------------
MATMUL_RULES = ("Sliced(last) x Sliced(K) -> Local; Replicated x Sliced(last) -> Sliced(last); "
                "Sliced(d) x Replicated -> Sliced(d) where b has no dimension d; Sliced(d) x Sliced(d) along a batch "
                "dimension both have -> Sliced(d); Local or Replicated x Replicated -> left layout")


@operation("matmul", R.MATMUL)
def matmul(a: Value, b: Value) -> Value:
    """a @ b for a of shape [..., K] and b of shape [K, N]; or, batched, b of shape [*B, K, N] and a of shape
    [..., *B, M, K] (one [K, N] matrix per index of the batch dimensions B, which a has as its last ones before
    [M, K]: each expert's weights applied to that expert's tokens)."""
    program = _program_of(a, b)
    a, b = lift(a, program), lift(b, program)
    vals = (a, b)
    if a.is_scalar or b.is_scalar or b.ndim < 2 or a.ndim < b.ndim - 1 or (b.ndim > 2 and a.ndim < b.ndim):
        raise _fail("matmul", vals, "needs a tensor of shape [..., K] and one of shape [K, N], or a tensor of shape "
                                    "[..., *B, M, K] and one of shape [*B, K, N]")
    if a.shape[-1] != b.shape[-2]:
        raise _fail("matmul", vals, f"inner dimensions differ ({a.shape[-1]} vs {b.shape[-2]})")
    if b.ndim > 2 and tuple(a.shape[a.ndim - b.ndim:-2]) != tuple(b.shape[:-2]):
        raise _fail("matmul", vals, f"the batch dimensions differ ({list(a.shape[a.ndim - b.ndim:-2])} vs "
                                    f"{list(b.shape[:-2])})")
    _float_only("matmul", vals)
    group = _common_group("matmul", vals)
    axes = _axes(group)
    per = [_matmul_placement(vals, _at(a, i, len(axes)), _at(b, i, len(axes)), axes[i]) for i in range(len(axes))]
    layout = make_layout(group, per)
    shape = tuple(a.shape[:-1]) + (b.shape[-1],)
    return program._add("matmul", vals, {}, promote(a.dtype, b.dtype), shape, layout, group)


def batch_dims(v: Value) -> range:
    """The dimensions of matmul `v` (and of its left operand) that index its right operand's batch of matrices."""
    a, b = v.args
    return range(a.ndim - b.ndim, a.ndim - 2) if b.ndim > 2 else range(0)


def _matmul_placement(vals: tuple[Value, Value], la: Placement, lb: Placement, axis: str | None) -> Placement:
    a, b = vals
    last, off = a.ndim - 1, a.ndim - b.ndim
    if la.is_sliced and la.dim == last and lb.is_sliced and lb.dim == b.ndim - 2:
        if la.shares != lb.shares:
            raise _fail("matmul", vals, f"the inner dimension is sliced in different shares{_along(axis)} "
                                        f"({la!r} x {lb!r})")
        return Local
    if la.is_replicated and lb.is_sliced and lb.dim == b.ndim - 1:
        return Sliced(last, lb.shares)
    batched = b.ndim > 2 and la.is_sliced and off <= la.dim < last - 1
    if batched and lb.is_sliced and lb.dim == la.dim - off:
        if la.shares != lb.shares:
            raise _fail("matmul", vals, f"the batch dimension is sliced in different shares{_along(axis)} "
                                        f"({la!r} x {lb!r})")
        return la
    if batched and lb.is_replicated:
        raise _fail("matmul", vals, f"`{a.name}` is sliced along batch dimension {la.dim}{_along(axis)} but "
                                    f"`{b.name}` is whole; slice `{b.name}` along its dimension {la.dim - off} too")
    if la.is_sliced and la.dim != last and lb.is_replicated:
        return la
    if (la.is_local or la.is_replicated) and lb.is_replicated:
        return la
    raise _fail("matmul", vals, f"no layout rule applies ({la!r} x {lb!r}{_along(axis)}); the rules are: "
                                f"{MATMUL_RULES}")


def _partition(total: int, parts: int, gen: torch.Generator) -> list[int]:
    """`total` cut at random into `parts` non-negative counts (zeros included)."""
    if parts == 0:
        return []
    cuts = sorted(torch.randint(0, total + 1, (parts - 1,), generator=gen).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _draw_segments(v: Value, per_rank: list[dict[str, Any]], sizes: Any, gen: torch.Generator, drawn: set[str]
                   ) -> None:
    """Random inputs' counts for grouped_matmul `v` where they are an input of the program (random integers would
    not fit its rows): where its rows are all_to_all_v's result and the counts hold one row of segments per source
    rank, row i partitions the rows received from rank i (the recv drawn before); otherwise the segments cover a
    random number of the rows, zeros and padding included."""
    # semantics fills in the meanings of the operations this module registers
    from .semantics import host_counts, local_rank

    c = v.args[2]
    if c.op != "input" or c.name in drawn:
        return
    x, m = v.args[0], bind_shape(v.args[0].shape, sizes)[0]
    recv = x.args[2] if x.op == "all_to_all_v" and x.attrs["dim"] == 0 else None
    same: dict[int, torch.Tensor] = {}  # one draw per set of ranks holding the same counts (Replicated ones)
    for rank in v.group.ranks(len(per_rank)):
        t = per_rank[rank][c.name]
        g = t.shape[-1] if t.ndim else 1
        lines = t.numel() // g if g else 0
        got = per_rank[rank].get(recv.name) if recv is not None else None
        if got is not None and got.numel() == lines > 0:  # each source rank's rows, split among the groups
            totals, each = host_counts(got), g
        else:
            key = local_rank(c.layout, c.position(rank, len(per_rank)))
            if key not in same:
                same[key] = _partition(int(torch.randint(0, m + 1, (), generator=gen)), t.numel(), gen)
            per_rank[rank][c.name] = torch.tensor(same[key], dtype=t.dtype, device=t.device).reshape(t.shape)
            continue
        segs = [k for total in totals for k in _partition(total, each, gen)]
        per_rank[rank][c.name] = torch.tensor(segs, dtype=t.dtype, device=t.device).reshape(t.shape)
    drawn.add(c.name)


@operation("grouped_matmul", R.MATMUL, draw=_draw_segments)
def grouped_matmul(x: Value, w: Value, counts: Value) -> Value:
    """Segment by segment matmul (a dropless MoE's expert GEMMs): x [M, K]'s rows are consecutive segments whose
    lengths are the runtime integer tensor `counts` read in row-major order; segment k is multiplied by w[k mod G]
    of w [G, K, N] (so counts [G] is one segment per expert, counts [R, G] one per source rank and expert, as
    all_to_all_v receives them); rows past sum(counts) are padding and give zero rows. Result [M, N]. With w Sliced
    along its experts, each rank's counts count its own experts' segments (G / ranks per line of counts)."""
    program = _program_of(x, w, counts)
    x, w, counts = (lift(t, program) for t in (x, w, counts))
    vals = (x, w, counts)
    if x.is_scalar or x.ndim != 2 or w.is_scalar or w.ndim != 3:
        raise _fail("grouped_matmul", vals, "needs rows x of shape [M, K] and one matrix per group, w [G, K, N]")
    if x.shape[1] != w.shape[1]:
        raise _fail("grouped_matmul", vals, f"inner dimensions differ ({x.shape[1]} vs {w.shape[1]})")
    if counts.is_scalar or counts.dtype not in ("int32", "int64"):
        raise _fail("grouped_matmul", vals, "`counts` holds segment lengths: an int32 or int64 tensor")
    _float_only("grouped_matmul", (x, w))
    group = _common_group("grouped_matmul", vals)
    axes = _axes(group)
    per, ranks = [], 1
    for i, ax in enumerate(axes):
        lx, lw, lc = (_at(t, i, len(axes)) for t in vals)
        if lx.is_sliced:
            why = ("its rows are sliced, which would cut segments across ranks; declare each rank's rows Local"
                   if lx.dim == 0 else "its inner dimension is sliced; all_gather it first")
            raise _fail("grouped_matmul", vals, f"`{x.name}` is {lx!r}{_along(ax)}: {why}")
        if lc.is_sliced:
            raise _fail("grouped_matmul", vals, f"`{counts.name}` is {lc!r}{_along(ax)}: each rank needs all of its "
                                                "segments' counts; declare them Local")
        if lw.is_sliced and lw.dim != 0:
            raise _fail("grouped_matmul", vals, f"`{w.name}` is {lw!r}{_along(ax)}: only its experts (dimension 0) "
                                                "may be sliced; all_gather it first")
        if lw.is_sliced:
            if lw.shares is not None:
                raise _fail("grouped_matmul", vals, f"`{w.name}`'s experts are sliced in shares {lw.shares}"
                                                    f"{_along(ax)}; the counts need equal parts")
            size = group.mesh.shape[i] if group is not None and group.mesh is not None else None
            ranks = ranks * size if size is not None and ranks is not None else None
        per.append(Replicated if lx.is_replicated and lw.is_replicated and lc.is_replicated else Local)
    g, last = w.shape[0], counts.shape[-1] if counts.ndim else 1
    if ranks is not None and isinstance(g, int) and isinstance(last, int):
        if g % ranks or last != g // ranks:
            raise _fail("grouped_matmul", vals, f"`{counts.name}`'s last dimension ({last}) must be the number of "
                                                f"groups each rank holds ({g} over {ranks} ranks)")
    return program._add("grouped_matmul", vals, {}, promote(x.dtype, w.dtype), (x.shape[0], w.shape[2]),
                        make_layout(group, per), group)


@operation("grouped_matmul_wgrad", R.MATMUL, draw=_draw_segments)
def grouped_matmul_wgrad(x: Value, dy: Value, counts: Value) -> Value:
    """grouped_matmul's weight gradient: for x [M, K] and dy [M, N] in the same consecutive segments of the runtime
    counts (row-major, G per line), group g's [K, N] is the sum over its segments of x_segᵀ dy_seg (rows past
    sum(counts) are padding and add nothing). Result [G, K, N], G = the counts' last dimension: with grouped_matmul's
    w Sliced along its experts, this rank's own experts' gradients, Local like its counts."""
    program = _program_of(x, dy, counts)
    x, dy, counts = (lift(t, program) for t in (x, dy, counts))
    vals = (x, dy, counts)
    if x.is_scalar or x.ndim != 2 or dy.is_scalar or dy.ndim != 2:
        raise _fail("grouped_matmul_wgrad", vals, "needs rows x of shape [M, K] and their gradients dy of shape "
                                                  "[M, N]")
    if x.shape[0] != dy.shape[0]:
        raise _fail("grouped_matmul_wgrad", vals, f"x and dy hold different numbers of rows ({x.shape[0]} vs "
                                                  f"{dy.shape[0]})")
    if counts.is_scalar or counts.dtype not in ("int32", "int64"):
        raise _fail("grouped_matmul_wgrad", vals, "`counts` holds segment lengths: an int32 or int64 tensor")
    _float_only("grouped_matmul_wgrad", (x, dy))
    group = _common_group("grouped_matmul_wgrad", vals)
    axes = _axes(group)
    per = []
    for i, ax in enumerate(axes):
        places = [_at(t, i, len(axes)) for t in vals]
        for t, place in zip(vals, places):
            if place.is_sliced:
                raise _fail("grouped_matmul_wgrad", vals, f"`{t.name}` is {place!r}{_along(ax)}: each rank sums "
                                                          "over its own whole segments; declare it Local")
        per.append(Replicated if all(place.is_replicated for place in places) else Local)
    g = counts.shape[-1] if counts.ndim else 1
    return program._add("grouped_matmul_wgrad", vals, {}, promote(x.dtype, dy.dtype), (g, x.shape[1], dy.shape[1]),
                        make_layout(group, per), group)


@operation("layer_norm", R.NORMALISATION, ("eps", "has_weight", "has_bias"), rebuild=lambda p, args, a: layer_norm(
    args[0], args[1] if a["has_weight"] else None, args[1 + a["has_weight"]] if a["has_bias"] else None, a["eps"]))
def layer_norm(x: Value, weight: Value | None = None, bias: Value | None = None, eps: float = 1e-5) -> Value:
    """Normalise over the last dimension, then scale by `weight` and shift by `bias` (both [H])."""
    program = _program_of(x)
    x = lift(x, program)
    ops = [x] + [lift(t, program) for t in (weight, bias) if t is not None]
    if x.is_scalar or x.ndim < 1:
        raise _fail("layer_norm", ops, "needs a tensor operand")
    _float_only("layer_norm", ops)
    if any(p.is_sliced and p.dim == x.ndim - 1 for p in placements(x.layout, len(_axes(x.group)))):
        raise _fail("layer_norm", ops, "normalises over the last dimension, which is sliced; all_gather first")
    for t in ops[1:]:
        if t.shape != (x.shape[-1],):
            raise _fail("layer_norm", ops, f"`{t.name}` must have shape [{x.shape[-1]}]")
    layout = elementwise_layout("layer_norm", ops, x.shape)
    group = _common_group("layer_norm", ops)
    attrs = {"eps": float(eps), "has_weight": weight is not None, "has_bias": bias is not None}
    return program._add("layer_norm", tuple(ops), attrs, x.dtype, x.shape, layout, group)


# -- communication ----------------------------------------------------------------------------
def _check_reduce_op(name: str, x: Value, op: str, allowed: Sequence[str] = REDUCE_OPS) -> None:
    if op not in allowed:
        raise _fail(name, (x,), f"unknown reduction {op!r}; use one of {', '.join(allowed)}")


def _tensor_operand(name: str, x: Any) -> Value:
    v = lift(x, _program_of(x))
    if v.is_scalar:
        raise _fail(name, (v,), "communication needs a tensor operand, not a scalar")
    return v


def _axis(name: str, x: Value, axis: str | None) -> tuple[int, str | None]:
    """(index, attribute) of the mesh axis a collective runs over: the attribute is the axis name on a mesh of
    several axes and None otherwise (a program without a mesh, or with one axis, is the original model)."""
    mesh = x.group.mesh
    if mesh is None:
        if axis is not None:
            raise _fail(name, (x,), f"the program has no mesh, so it runs over the whole process group; leave out "
                                    f"axis={axis!r} or declare the mesh with p.mesh(...)")
        return 0, None
    if axis is None:
        if len(mesh.axes) > 1:
            raise _fail(name, (x,), f"say which mesh axis it runs over: axis= one of {', '.join(mesh.axes)}")
        return 0, None
    if axis not in mesh.axes:
        raise _fail(name, (x,), f"the mesh {mesh} has no axis {axis!r}")
    return mesh.axes.index(axis), (axis if len(mesh.axes) > 1 else None)


def _with(x: Value, i: int, p: Placement) -> Layout:
    """x's layout with placement `p` along axis `i`."""
    per = list(placements(x.layout, len(_axes(x.group))))
    per[i] = p
    return make_layout(x.group, per)


def _innermost(name: str, x: Value, i: int, d: int, verb: str) -> None:
    """Refuse to slice or gather dimension d along axis i when a later axis slices it (parts nest in mesh order)."""
    axes = _axes(x.group)
    per = placements(x.layout, len(axes))
    later = [axes[k] for k in range(i + 1, len(axes)) if per[k].is_sliced and per[k].dim == d]
    if later:
        raise _fail(name, (x,), f"dimension {d} is also sliced by axis `{later[0]}`, after axis `{axes[i]}` in the "
                                f"mesh; {verb} along `{later[0]}` first (a dimension sliced by several axes is split "
                                "in mesh order)")


def _counts(name: str, x: Value, values: Any, i: int, what: str) -> tuple[int, ...] | None:
    """`values` (shares or weights) as positive ints, one per rank along axis i when the mesh fixes its size."""
    if values is None:
        return None
    try:
        out = check_shares(values, f"{name} {what}")
    except ProgramError as e:
        raise _fail(name, (x,), str(e).split(": ", 1)[1]) from None
    mesh = x.group.mesh
    if mesh is not None and len(out) != mesh.shape[i]:
        raise _fail(name, (x,), f"{what} {out} name {len(out)} ranks, the axis has {mesh.shape[i]}")
    return out


def _weights(name: str, x: Value, op: str, weights: Any, i: int) -> tuple[int, ...] | None:
    if weights is not None and op != "avg":
        raise _fail(name, (x,), f"weights make a weighted average; use op='avg', not {op!r}")
    w = _counts(name, x, weights, i, "weights")
    return None if w is None or len(set(w)) == 1 else w


def wire_reduction(v: Value) -> str:
    """The reduction a collective's runtime call runs: a weighted average sums operands scaled by their weights."""
    return "sum" if v.attrs.get("weights") is not None else v.attrs["op"]


def collective_operand(name: str, x: Any, axis: str | None) -> tuple[Value, int, str | None, Placement]:
    """What a collective kind's builder starts from: its operand as a tensor value, the index of the mesh axis it
    runs over, that axis as the value's attribute (None without a mesh of several axes) and the operand's placement
    along it."""
    x = _tensor_operand(name, x)
    i, ax = _axis(name, x, axis)
    return x, i, ax, _at(x, i, len(_axes(x.group)))


def collective_result(name: str, x: Value, attrs: dict[str, Any], i: int, placement: Placement) -> Value:
    """Add collective `name` of `x` to its program: x's dtype, shape and group, x's layout with `placement` along
    mesh axis `i` (the layout rule's answer)."""
    return x.program._add(name, (x,), attrs, x.dtype, x.shape, _with(x, i, placement), x.group)


def refuse(name: str, x: Value, rule: str) -> ProgramError:
    """The error of a collective kind's builder refusing operand `x`: where it was written, the operand, the rule."""
    return _fail(name, (x,), rule)


def all_reduce(x: Value, op: str = "sum", axis: str | None = None, weights: Sequence[int] | None = None) -> Value:
    """Combine the Local tensors of the ranks along mesh axis `axis` with `op`; each of them gets the result
    (Replicated along the axis). `weights` (one positive int per rank, e.g. its sample count) make "avg" the
    weighted average sum(w_r x_r) / sum(w_r)."""
    x = _tensor_operand("all_reduce", x)
    _check_reduce_op("all_reduce", x, op)
    i, ax = _axis("all_reduce", x, axis)
    p = _at(x, i, len(_axes(x.group)))
    if not p.is_local:
        got = f"{x.layout!r}" if ax is None else f"{p!r} along axis `{ax}`"
        raise _fail("all_reduce", (x,), f"needs a Local operand (per-rank values to combine), got {got}")
    if op == "adasum" and not is_float(x.dtype):
        raise _fail("all_reduce", (x,), "adasum needs a floating-point operand")
    w = _weights("all_reduce", x, op, weights, i)
    return x.program._add("all_reduce", (x,), {"op": op, "axis": ax, "weights": w}, x.dtype, x.shape,
                          _with(x, i, Replicated), x.group)


register_kind(CollectiveKind(
    "all_reduce", "AR", all_reduce, attrs=("op", "axis", "weights"),
    rebuild=lambda p, args, a: all_reduce(args[0], a["op"], a["axis"], a["weights"]),
    reference=lambda v, parts, combine: [combine(v.attrs["op"], parts, v.attrs.get("weights"))] * len(parts),
    call=lambda v, shape: ((wire_reduction(v),), ()),
    benchmark=lambda b: lambda: dist.all_reduce(b.x), recorded={"all_reduce": (0, False)}))


def reduce_scatter(x: Value, op: str = "sum", dim: int = 0, axis: str | None = None,
                   shares: Sequence[int] | None = None, weights: Sequence[int] | None = None) -> Value:
    """Combine the Local tensors of the ranks along `axis` with `op`; the i-th of them keeps part i along
    `dim` (Sliced(dim, shares): equal parts, or in proportion to `shares`). `weights` as in all_reduce."""
    x = _tensor_operand("reduce_scatter", x)
    _check_reduce_op("reduce_scatter", x, op, ("sum", "avg", "max", "min"))
    i, ax = _axis("reduce_scatter", x, axis)
    p = _at(x, i, len(_axes(x.group)))
    if not p.is_local:
        got = f"{x.layout!r}" if ax is None else f"{p!r} along axis `{ax}`"
        raise _fail("reduce_scatter", (x,), f"needs a Local operand, got {got}")
    d = _norm_dims("reduce_scatter", x, dim)[0]
    _innermost("reduce_scatter", x, i, d, "scatter")
    s = _counts("reduce_scatter", x, shares, i, "shares")
    out = Sliced(d, s)
    w = _weights("reduce_scatter", x, op, weights, i)
    return x.program._add("reduce_scatter", (x,), {"op": op, "dim": d, "axis": ax, "shares": out.shares, "weights": w},
                          x.dtype, x.shape, _with(x, i, out), x.group)


def _scatter(v: Value, parts: list[torch.Tensor], combine: Any) -> list[torch.Tensor]:
    whole = combine(v.attrs["op"], parts, v.attrs.get("weights"))
    sizes = split_sizes(whole.shape[v.attrs["dim"]], v.attrs.get("shares") or len(parts))
    return [part.clone() for part in whole.split(sizes, v.attrs["dim"])]


register_kind(CollectiveKind(
    "reduce_scatter", "RS", reduce_scatter, attrs=("op", "dim", "axis", "shares", "weights"),
    rebuild=lambda p, args, a: reduce_scatter(args[0], a["op"], a["dim"], a["axis"], a["shares"], a["weights"]),
    reference=_scatter, call=lambda v, shape: ((wire_reduction(v), v.attrs["dim"]), ()),
    shares=lambda v: v.attrs.get("shares"),
    benchmark=lambda b: lambda: dist.reduce_scatter_tensor(b.part, b.x[: b.part.numel() * b.p]),
    recorded={"reduce_scatter_tensor": (1, False), "reduce_scatter_single": (1, False)}))


def all_gather(x: Value, dim: int | None = None, axis: str | None = None) -> Value:
    """Concatenate the slices of the ranks along `axis`; each of them gets the whole (Replicated along it)."""
    x = _tensor_operand("all_gather", x)
    i, ax = _axis("all_gather", x, axis)
    p = _at(x, i, len(_axes(x.group)))
    if not p.is_sliced:
        got = f"{x.layout!r}" if ax is None else f"{p!r} along axis `{ax}`"
        raise _fail("all_gather", (x,), f"needs a Sliced operand, got {got}")
    if dim is not None and _norm_dims("all_gather", x, dim)[0] != p.dim:
        raise _fail("all_gather", (x,), f"gathers along the sliced dimension {p.dim}, not {dim}")
    _innermost("all_gather", x, i, p.dim, "gather")
    return x.program._add("all_gather", (x,), {"dim": p.dim, "axis": ax}, x.dtype, x.shape,
                          _with(x, i, Replicated), x.group)


register_kind(CollectiveKind(
    "all_gather", "AG", all_gather, attrs=("dim", "axis"),
    rebuild=lambda p, args, a: all_gather(args[0], a["dim"], a["axis"]),
    reference=lambda v, parts, combine: [torch.cat(parts, dim=v.attrs["dim"])] * len(parts),
    call=lambda v, shape: ((v.attrs["dim"], shape[v.attrs["dim"]]), ()),
    shares=lambda v: v.args[0].along(v.attrs.get("axis")).shares,
    benchmark=lambda b: lambda: dist.all_gather_into_tensor(b.full, b.part),
    recorded={"all_gather_into_tensor": (0, False), "all_gather_single": (0, False), "all_gather": (1, True)}))


def all_to_all(x: Value, dim: int, axis: str | None = None, shares: Sequence[int] | None = None, *,
               splits: Value | None = None, recv: Value | None = None, rows: int | str | None = None) -> Value:
    """Move the slicing of a tensor Sliced along one dimension across the ranks of `axis` to dimension `dim`
    (Sliced(dim, shares): equal parts, or in proportion to `shares`): each rank sends every other rank the piece of
    its part that rank keeps. The whole tensor is unchanged. This is MoE's dispatch and combine (a tensor of
    [source rank, expert, ...] sliced by source becomes sliced by expert) and DTensor's Shard(a) -> Shard(b).

    With `splits` (and `recv`), the splits are runtime values instead (`all_to_all_v`: a dropless MoE's dispatch and
    combine, whose row counts routing decides each step)."""
    if splits is not None or recv is not None or rows is not None:
        if shares is not None:
            raise _fail("all_to_all", (_tensor_operand("all_to_all", x),),
                        "shares= are static parts of a Sliced tensor; runtime splits= take none")
        return all_to_all_v(x, splits, recv, dim, axis, rows)
    x = _tensor_operand("all_to_all", x)
    i, ax = _axis("all_to_all", x, axis)
    p = _at(x, i, len(_axes(x.group)))
    if not p.is_sliced:
        got = f"{x.layout!r}" if ax is None else f"{p!r} along axis `{ax}`"
        raise _fail("all_to_all", (x,), f"needs a Sliced operand (each rank's part along one dimension), got {got}; "
                                        "slice a Replicated one, reduce_scatter a Local one")
    d = _norm_dims("all_to_all", x, dim)[0]
    if d == p.dim:
        raise _fail("all_to_all", (x,), f"`{x.name}` is already sliced along dimension {d}; all_to_all moves the "
                                        "slicing to another dimension")
    _innermost("all_to_all", x, i, p.dim, "gather")
    _innermost("all_to_all", x, i, d, "slice")
    out = Sliced(d, _counts("all_to_all", x, shares, i, "shares"))
    return x.program._add("all_to_all", (x,), {"dim": d, "axis": ax, "shares": out.shares}, x.dtype, x.shape,
                          _with(x, i, out), x.group)


def _exchange(v: Value, parts: list[torch.Tensor], combine: Any) -> list[torch.Tensor]:
    """The ranks' parts along the operand's sliced dimension, joined, then cut into the parts along v's."""
    whole = torch.cat(parts, dim=v.args[0].along(v.attrs["axis"]).dim)
    sizes = split_sizes(whole.shape[v.attrs["dim"]], v.attrs.get("shares") or len(parts))
    return [part.clone() for part in whole.split(sizes, v.attrs["dim"])]


def _exchange_call(v: Value, shape: tuple[int, ...]) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]:
    """The operand's sliced dimension, the result's, the whole size along the former; its parts' shares."""
    src = v.args[0].along(v.attrs.get("axis"))
    return (src.dim, v.attrs["dim"], shape[src.dim]), (("src_shares", src.shares),)


def _exchange_benchmark(b: Any) -> Any:
    """Calibration's library call of an all_to_all (even splits): all_to_all's and all_to_all_v's lines."""
    return lambda: dist.all_to_all_single(b.exchanged, b.x)


register_kind(CollectiveKind(
    "all_to_all", "A2A", all_to_all, attrs=("dim", "axis", "shares"),
    rebuild=lambda p, args, a: all_to_all(args[0], a["dim"], a["axis"], a["shares"]),
    reference=_exchange, call=_exchange_call, shares=lambda v: v.attrs.get("shares"),
    benchmark=_exchange_benchmark, recorded={"all_to_all_single": (1, False)},
    opens_chain=True))


def all_to_all_v(x: Value, splits: Value, recv: Value, dim: int = 0, axis: str | None = None,
                 rows: int | str | None = None) -> Value:
    """An all_to_all whose splits are runtime values (MPI's alltoallv, a dropless MoE's dispatch and combine): rank
    r's rows along `dim` (Local along `axis`: each rank its own) go splits_r[0] to group rank 0, the next splits_r[1]
    to rank 1, ...; rank j receives recv_j[i] rows from rank i, in rank order. `splits` and `recv` are integer
    tensors holding one count per rank of the axis on each rank (any shape; recv_j[i] must equal splits_i[j]: the
    counts' own even all_to_all gives it). Shapes stay static: the operand's rows past sum(splits) are not sent and the
    result has `rows` rows (default: the operand's), those past sum(recv) zero. Its adjoint is the same call with
    `splits` and `recv` swapped."""
    name = "all_to_all_v"
    x = _tensor_operand(name, x)
    i, ax = _axis(name, x, axis)
    n = len(_axes(x.group))
    p = _at(x, i, n)
    if not p.is_local:
        got = f"{x.layout!r}" if ax is None else f"{p!r} along axis `{ax}`"
        rule = ("a Replicated operand holds the same rows on every rank; declare each rank's own rows Local"
                if p.is_replicated else "a Sliced operand moves with the static form, all_to_all(x, dim, shares=)")
        raise _fail(name, (x,), f"needs a Local operand (each rank's own rows, ordered by destination), got {got}; "
                                + rule)
    d = _norm_dims(name, x, dim)[0]
    sliced = [a for a, q in zip(_axes(x.group), placements(x.layout, n)) if q.is_sliced and q.dim == d]
    if sliced:
        raise _fail(name, (x,), f"its rows dimension {d} is sliced along axis `{sliced[0]}`; the rows a rank sends "
                                "must be whole on it (gather them first)")
    ranks = x.group.mesh.shape[i] if x.group.mesh is not None else None
    counts = []
    for what, c in (("splits", splits), ("recv", recv)):
        if not isinstance(c, Value) or c.is_scalar or c.program is not x.program:
            raise _fail(name, (x,), f"`{what}` must be an integer tensor of this program (one count per rank), "
                                    f"got {c!r}")
        if c.dtype not in ("int32", "int64"):
            raise _fail(name, (x, c), f"`{what}` holds row counts: an int32 or int64 tensor, not {c.dtype}")
        if c.group != x.group:
            raise _fail(name, (x, c), f"`{what}` lives on another process group than the rows")
        static = [s for s in c.shape if isinstance(s, int)]
        whole = all(isinstance(s, int) for s in c.shape) and not c.layout.is_sliced
        if ranks is not None and whole and len(static) == len(c.shape) and torch.Size(static).numel() != ranks:
            raise _fail(name, (x, c), f"`{what}` holds {torch.Size(static).numel()} counts on each rank; the axis "
                                      f"has {ranks} ranks, one count each")
        counts.append(c)
    if rows is not None and not (isinstance(rows, int) and rows >= 0 or isinstance(rows, str) and rows.isidentifier()):
        raise _fail(name, (x,), f"rows (the receive capacity) must be a non-negative int or a size name, got {rows!r}")
    rows = x.shape[d] if rows is None else rows
    shape = x.shape[:d] + (rows,) + x.shape[d + 1:]
    return x.program._add(name, (x, *counts), {"dim": d, "axis": ax, "rows": rows}, x.dtype, shape, x.layout,
                          x.group)


def row_counts(t: Any, n: int, what: str, where: str) -> list[int]:
    """all_to_all_v's counts operand `what` (a tensor) as n non-negative ints on the host: the reference's and the
    torch backend's one check (InputError naming `where` otherwise)."""
    from .semantics import host_counts

    c = host_counts(t)
    if len(c) != n or builtins.min(c, default=0) < 0:
        raise InputError(f"{where}: `{what}` must hold {n} non-negative row counts (one per rank), got {c}")
    return c


def _draw_counts(v: Value, per_rank: list[dict[str, Any]], sizes: Any, gen: torch.Generator, drawn: set[str]
                 ) -> None:
    """Random inputs' counts that agree where all_to_all_v `v`'s counts are inputs of the program (random integers
    would not): along each line of its axis, rank i sends rank j c[i][j] rows, at most its rows and at most 1/p of
    the result's rows in all (so every rank's rows fit), zeros included; `splits` on rank i is row i, `recv` on rank
    j column j. Counts in `drawn` (an earlier one's: the combine's, swapped) are kept; those drawn join it."""
    s, r = v.args[1], v.args[2]
    if s.op != "input" or r.op != "input" or {s.name, r.name} & drawn:
        return
    d = v.attrs["dim"]
    sent, rows = bind_shape(v.args[0].shape, sizes)[d], bind_shape(v.shape, sizes)[d]
    for line in v.group.lines(len(per_rank), v.attrs.get("axis")):
        p = len(line)
        c = []
        for _ in line:
            total = int(torch.randint(0, builtins.min(sent, rows // p) + 1, (), generator=gen))
            c.append(_partition(total, p, gen))
        for k, rank in enumerate(line):
            for name, counts in ((s.name, c[k]), (r.name, [c[i][k] for i in range(p)])):
                t = per_rank[rank][name]
                if t.numel() == p:
                    per_rank[rank][name] = torch.tensor(counts, dtype=t.dtype, device=t.device).reshape(t.shape)
    drawn |= {s.name, r.name}


def _exchange_v(v: Value, parts: list[Any], combine: Any) -> list[torch.Tensor]:
    """Each rank's rows for rank j, in rank order, padded with zero rows to the result's size."""
    d, n = v.attrs["dim"], len(parts)
    where = f"all_to_all_v `{v.name}`"
    sends = [row_counts(s, n, "splits", where) for _, s, _, _ in parts]
    for (x, _, _, _), k in zip(parts, sends):
        if builtins.sum(k) > x.shape[d]:
            raise InputError(f"{where}: a rank's splits {k} sum to {builtins.sum(k)} rows but it holds {x.shape[d]}")
    out = []
    for j, (x, _, r, _) in enumerate(parts):
        got = row_counts(r, n, "recv", where)
        if got != [s[j] for s in sends]:
            raise InputError(f"{where}: rank {j} expects {got} rows from the ranks but they send it "
                             f"{[s[j] for s in sends]}; recv on rank j must be every rank's splits[j]")
        pieces = [src.narrow(d, builtins.sum(s[:j]), s[j]) for (src, _, _, _), s in zip(parts, sends)]
        out.append(torch.cat(pieces, d) if pieces else x.narrow(d, 0, 0))
    rows = parts[0][3][d]  # the result's rows, bound
    res = []
    for t in out:
        if t.shape[d] > rows:
            raise InputError(f"{where}: a rank receives {t.shape[d]} rows but the result holds {rows}")
        pad = list(t.shape)
        pad[d] = rows - t.shape[d]
        res.append(torch.cat([t, t.new_zeros(pad)], d))
    return res


register_kind(CollectiveKind(
    "all_to_all_v", "A2AV", all_to_all_v, attrs=("dim", "axis", "rows"),
    rebuild=lambda p, args, a: all_to_all_v(args[0], args[1], args[2], a["dim"], a["axis"], a["rows"]),
    reference=_exchange_v, call=lambda v, shape: ((v.attrs["dim"], shape[v.attrs["dim"]]), ()),
    benchmark=_exchange_benchmark, draw=_draw_counts, chunkable=False, row_counts=True))


def broadcast(x: Value, root: int = 0, axis: str | None = None) -> Value:
    """Every rank along `axis` gets the tensor of rank `root` along it (Replicated along the axis)."""
    x = _tensor_operand("broadcast", x)
    i, ax = _axis("broadcast", x, axis)
    if _at(x, i, len(_axes(x.group))).is_sliced:
        raise _fail("broadcast", (x,), "needs a Local or Replicated operand; all_gather a Sliced one")
    if not isinstance(root, int) or root < 0:
        raise _fail("broadcast", (x,), f"root must be a non-negative group rank, got {root!r}")
    return x.program._add("broadcast", (x,), {"root": root, "axis": ax}, x.dtype, x.shape, _with(x, i, Replicated),
                          x.group)


def _root(v: Value, n: int) -> int:
    if v.attrs["root"] >= n:
        raise InputError(f"{v.op} `{v.name}`: root {v.attrs['root']} is outside its group of {n} ranks")
    return v.attrs["root"]


register_kind(CollectiveKind(
    "broadcast", "BC", broadcast, attrs=("root", "axis"),
    rebuild=lambda p, args, a: broadcast(args[0], a["root"], a["axis"]),
    reference=lambda v, parts, combine: [parts[_root(v, len(parts))]] * len(parts),
    call=lambda v, shape: ((v.attrs["root"],), ()),
    benchmark=lambda b: lambda: dist.broadcast(b.x, 0), recorded={"broadcast": (0, False)}, chunkable=False))


def reduce(x: Value, op: str = "sum", root: int = 0, axis: str | None = None) -> Value:
    """Combine the Local tensors of the ranks along `axis` with `op` onto rank `root` along it; the other
    ranks keep their own input (the result is Local)."""
    x = _tensor_operand("reduce", x)
    _check_reduce_op("reduce", x, op, ("sum", "avg", "max", "min"))
    i, ax = _axis("reduce", x, axis)
    if not _at(x, i, len(_axes(x.group))).is_local:
        raise _fail("reduce", (x,), f"needs a Local operand, got {x.layout!r}")
    if not isinstance(root, int) or root < 0:
        raise _fail("reduce", (x,), f"root must be a non-negative group rank, got {root!r}")
    return x.program._add("reduce", (x,), {"op": op, "root": root, "axis": ax}, x.dtype, x.shape, x.layout, x.group)


def _reduce_to_root(v: Value, parts: list[torch.Tensor], combine: Any) -> list[torch.Tensor]:
    root, res = _root(v, len(parts)), combine(v.attrs["op"], parts)
    return [res if r == root else p.clone() for r, p in enumerate(parts)]


register_kind(CollectiveKind(
    "reduce", "R", reduce, attrs=("op", "root", "axis"),
    rebuild=lambda p, args, a: reduce(args[0], a["op"], a["root"], a["axis"]),
    reference=_reduce_to_root, call=lambda v, shape: ((v.attrs["op"], v.attrs["root"]), ()),
    benchmark=lambda b: lambda: dist.reduce(b.x, 0), recorded={"reduce": (0, False)}, chunkable=False))


@operation("send", R.P2P, ("to",),
           rebuild=lambda p, args, a: send(args[0], next(g for g in p.groups if g.name == a["to"])))
def send(x: Value, to: Group) -> Value:
    """Send to process group `to` (the next pipeline stage): group rank i of x's group sends its
    part to group rank i of `to`. Returns the tensor as received there, in the same layout."""
    x = _tensor_operand("send", x)
    if not isinstance(to, Group) or to not in x.program.groups:
        raise _fail("send", (x,), f"the destination must be a process group of this program, got {to!r}")
    if to == x.group:
        raise _fail("send", (x,), f"`{x.name}` already lives on `{to.name}`")
    return x.program._add("send", (x,), {"to": to.name}, x.dtype, x.shape, x.layout, to)


recv = send  # the receiving side of the same transfer; one op describes both ends


# -- state ------------------------------------------------------------------------------------
@operation("update", R.STATE)
def update(state: Value, value: Any) -> Value:
    """Write `value` into the tensor input `state` in place; returns the updated value."""
    if not isinstance(state, Value) or state.op != "input":
        raise ProgramError(f"update: the target must be a tensor input of the program, got {state!r}")
    program = state.program
    value = lift(value, program)
    vals = (state, value)
    if state.name in program.updates:
        raise _fail("update", vals, f"`{state.name}` is already updated once; a state is updated at most once")
    if value.is_scalar:
        raise _fail("update", vals, "the new value must be a tensor")
    if value.shape != state.shape:
        raise _fail("update", vals, "the new value must have the state's shape")
    if value.dtype != state.dtype:
        raise _fail("update", vals, f"the new value is {value.dtype} but the state is {state.dtype}; use cw.cast")
    if value.layout != state.layout:
        raise _fail("update", vals, f"the new value is {value.layout!r} but the state is {state.layout!r}")
    if value.group != state.group:
        raise _fail("update", vals, "the new value lives on another process group")
    v = program._add("update", vals, {}, state.dtype, state.shape, state.layout, state.group,
                     name=f"{state.name}'")
    program.updates[state.name] = v
    return v


# -- local re-layout --------------------------------------------------------------------------
@operation("slice", R.LAYOUT, ("dim", "axis", "shares"),
           rebuild=lambda p, args, a: slice(args[0], a["dim"], a["axis"], a["shares"]))
def slice(x: Value, dim: int = 0, axis: str | None = None, shares: Sequence[int] | None = None) -> Value:  # noqa: A001
    """Keep this rank's part along `axis` of a tensor Replicated along it (Sliced(dim, shares)); no communication."""
    x = _tensor_operand("slice", x)
    i, ax = _axis("slice", x, axis)
    if not _at(x, i, len(_axes(x.group))).is_replicated:
        raise _fail("slice", (x,), f"needs a Replicated operand, got {x.layout!r}")
    d = _norm_dims("slice", x, dim)[0]
    _innermost("slice", x, i, d, "slice")
    out = Sliced(d, _counts("slice", x, shares, i, "shares"))
    return x.program._add("slice", (x,), {"dim": d, "axis": ax, "shares": out.shares}, x.dtype, x.shape,
                          _with(x, i, out), x.group)


for _source in ("input", "scalar", "const"):  # made by Program.tensor / scalar and by constants, not by a builder
    R.register(_source, R.SOURCE)
