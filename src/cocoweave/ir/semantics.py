"""What every computation means on one rank's local tensors, in plain torch ops.

This is the one meaning of the DSL's computations: each is attached to its entry of the operation table
(`registry.REGISTRY[op].meaning`); the reference backend evaluates every computation through it and the
torch backend's generated code is tested against it. Half-precision values are computed in float32 and
rounded once per operation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import rng
from ..errors import InputError
from . import registry as R
from .graph import Value
from .layout import Position, cut, part_bounds, placements
from .types import DTYPES, bind_shape

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Place:
    """Where a rank sits for one value: its position in the value's process group (mesh coordinates), the
    bound sizes, and, inside a chunked chain, (dim, ndim of the chain, start, length) of the chunk."""

    pos: Position
    sizes: Mapping[str, int]
    chunk: tuple[int, int, int, int] | None = None


def align(arg: Value, t: Any, out: Value, place: Place) -> Any:
    """Cut an operand to the part of the result this rank computes: a Replicated operand (along an axis where
    the result is Sliced) is narrowed to the rank's part, unless the dimension is broadcast (size 1)."""
    if out.is_scalar or arg.is_scalar:
        return t
    full = bind_shape(arg.shape, place.sizes)
    have = part_bounds(arg.layout, full, place.pos)
    want = part_bounds(out.layout, bind_shape(out.shape, place.sizes), place.pos)[out.ndim - arg.ndim:]
    want = [h if n == 1 else w for h, w, n in zip(have, want, full)]
    return cut(t, have, want)


def local_rank(layout: Any, pos: Position) -> int:
    """The index that tells apart the ranks holding different values of a Local tensor: the row-major index of
    the rank's coordinates along the axes where the layout is Local (rng.NO_RANK if none is)."""
    per = placements(layout, len(pos.coords))
    axes = [i for i, p in enumerate(per) if p.is_local]
    if not axes:
        return rng.NO_RANK
    return Position(tuple(pos.coords[i] for i in axes), tuple(pos.shape[i] for i in axes)).group_rank


def _up(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF else t


def _finish(v: Value, r: Any) -> Any:
    """Round a result to the value's dtype (scalars stay float64 host numbers)."""
    if v.is_scalar:
        return r if isinstance(r, torch.Tensor) else torch.tensor(r, dtype=torch.float64)
    dt = DTYPES[v.dtype]
    return r.to(dt) if r.dtype != dt else r


def dropout_index(v: Value, local_shape: tuple[int, ...], place: Place, device: torch.device) -> torch.Tensor:
    """Logical element indices of this rank's part of dropout's operand (rank-independent for
    Replicated; the rank's slice for Sliced; the full index for Local, whose key adds the rank)."""
    x = v.args[0]
    full = bind_shape(x.shape, place.sizes)
    idx = rng.logical_index(full, device)
    idx = cut(idx, [(0, n) for n in full], part_bounds(x.layout, full, place.pos))
    if place.chunk is not None:
        dim, nd, start, length = place.chunk
        j = dim - (nd - x.ndim)
        if j >= 0 and idx.shape[j] != 1:
            idx = idx.narrow(j, start, length)
    assert tuple(idx.shape) == tuple(local_shape), (idx.shape, local_shape)
    return idx


def reduce_local(op: str, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    """sum / max / min / norm over `dims` of a local tensor (float32 accumulation for halves)."""
    x = _up(x)
    if op == "sum":
        return torch.sum(x, dim=dims, keepdim=keepdim) if dims else x.clone()
    if op == "norm":
        return torch.linalg.vector_norm(x, dim=dims, keepdim=keepdim)
    if not dims:
        return x.clone()
    if x.numel() == 0:  # an empty slice: the identity of max / min, so all_reduce gives the true result
        shape = [1 if i in dims else s for i, s in enumerate(x.shape) if keepdim or i not in dims]
        return torch.full(shape, float("-inf") if op == "max" else float("inf"), dtype=x.dtype, device=x.device)
    fn = torch.amax if op == "max" else torch.amin
    return fn(x, dim=dims, keepdim=keepdim)


# -- the meaning of each computation: (value, local operands, place) -> local result --------------------
Meaning = Callable[[Value, list, Place], Any]


def _binary(fn: Callable) -> Meaning:
    return lambda v, a, place: _finish(v, fn(_up(a[0]), _up(a[1])))


def _unary(fn: Callable) -> Meaning:
    def meaning(v: Value, a: list, place: Place) -> Any:
        x = a[0]
        if fn is not torch.abs and fn is not torch.neg and not torch.is_floating_point(x):
            x = x.double() if v.is_scalar else x.float()
        return _finish(v, fn(_up(x)))

    return meaning


def _const(v: Value, a: list, place: Place) -> torch.Tensor:
    x = v.attrs["value"]
    return torch.tensor(x, dtype=torch.float64 if isinstance(x, float) else torch.int64)


def _dropout(v: Value, a: list, place: Place) -> Any:
    seed = v.attrs["seed"] if v.attrs["seed"] is not None else int(a[1])
    x = a[0]
    rank = local_rank(v.args[0].layout, place.pos)
    idx = dropout_index(v, tuple(x.shape), place, x.device)
    if v.attrs.get("offset"):
        idx = idx + int(a[2])
    return _finish(v, rng.dropout(_up(x), idx, v.attrs["p"], seed, rank))


def _layer_norm(v: Value, a: list, place: Place) -> Any:
    x = a[0]
    w = a[1].float() if v.attrs["has_weight"] else None
    b = a[1 + v.attrs["has_weight"]].float() if v.attrs["has_bias"] else None
    return _finish(v, torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), w, b, v.attrs["eps"]))


def silu_grad(dy: Any, x: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """The DSL's silu_grad on tensors (Python numbers as float64, like the reference's scalars), the reference's and
    the torch backend's one body: torch's silu_backward, dy * s * (1 + x * (1 - s)) with s = sigmoid(x); `out`:
    written there (the torch backend's over dy, a temporary: one full-size allocation less)."""
    dy, x = (t if isinstance(t, torch.Tensor) else torch.as_tensor(float(t), dtype=torch.float64) for t in (dy, x))
    if not (dy.is_floating_point() or x.is_floating_point()):
        dy, x = dy.float(), x.float()
    if out is not None:
        return torch.ops.aten.silu_backward.grad_input(dy, x, grad_input=out)
    return torch.ops.aten.silu_backward(dy, x)


def host_counts(t: torch.Tensor) -> list[int]:
    """The row counts an integer tensor holds, in order, as ints on the host (where routing's counts are read)."""
    return [int(k) for k in t.reshape(-1).tolist()]


def segments(counts: torch.Tensor, rows: int, groups: int, where: str) -> list[tuple[int, int, int]]:
    """grouped_matmul's (start, length, group) per non-empty segment from its counts on the host: the reference's
    and the torch backend's one check (InputError naming `where` otherwise)."""
    c = host_counts(counts)
    g = counts.shape[-1] if counts.ndim else 1
    if g != groups:
        raise InputError(f"{where}: the counts hold {g} segments per line but the rank holds {groups} groups")
    if min(c, default=0) < 0 or sum(c) > rows:
        raise InputError(f"{where}: the counts {c} must be non-negative and sum to at most the {rows} rows")
    out, start = [], 0
    for k, n in enumerate(c):
        if n:
            out.append((start, n, k % groups))
        start += n
    return out


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, name: str) -> torch.Tensor:
    """The DSL's grouped_matmul `name` on tensors, the reference's (in float32) and the torch backend's (in the
    operands' dtype) one body: one mm per non-empty segment written into the result, its padding rows zeroed (the
    counts are read on the host for their check; torch._grouped_mm was at most 10% faster on CPU:
    docs/programs.md)."""
    out, end = x.new_empty(x.shape[0], w.shape[2]), 0
    for start, n, g in segments(counts, x.shape[0], w.shape[0], f"grouped_matmul `{name}`"):
        torch.mm(x[start:start + n], w[g], out=out[start:start + n])  # written in place; segments cover [0, end)
        end = start + n
    out[end:].zero_()  # the padding rows only
    return out


def grouped_matmul_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, name: str) -> torch.Tensor:
    """The DSL's grouped_matmul_wgrad `name` on tensors, the reference's (in float32) and the torch backend's (in
    the operands' dtype) one body: per group, the sum of x_segᵀ dy_seg over its non-empty segments (the first one
    mm written in place, the others one addmm each), a group without rows zero."""
    groups = counts.shape[-1] if counts.ndim else 1
    out, seen = x.new_empty(groups, x.shape[1], dy.shape[1]), set()
    for start, n, g in segments(counts, x.shape[0], groups, f"grouped_matmul_wgrad `{name}`"):
        if g in seen:
            out[g].addmm_(x[start:start + n].T, dy[start:start + n])
        else:
            torch.mm(x[start:start + n].T, dy[start:start + n], out=out[g])
            seen.add(g)
    for g in set(range(groups)) - seen:
        out[g].zero_()
    return out


MEANINGS: dict[str, Meaning] = {
    "const": _const,
    "add": _binary(torch.add), "sub": _binary(torch.sub), "mul": _binary(torch.mul), "div": _binary(torch.div),
    "pow": _binary(torch.pow), "maximum": _binary(torch.maximum), "minimum": _binary(torch.minimum),
    "lt": _binary(torch.lt), "le": _binary(torch.le), "gt": _binary(torch.gt), "ge": _binary(torch.ge),
    "eq": _binary(torch.eq), "ne": _binary(torch.ne),
    "neg": _unary(torch.neg), "sqrt": _unary(torch.sqrt), "rsqrt": _unary(torch.rsqrt), "exp": _unary(torch.exp),
    "sigmoid": _unary(torch.sigmoid), "silu": _unary(torch.nn.functional.silu), "abs": _unary(torch.abs),
    "silu_grad": _binary(silu_grad),
    "cast": lambda v, a, place: a[0].to(DTYPES[v.dtype]),
    "where": lambda v, a, place: _finish(v, torch.where(a[0], _up(a[1]), _up(a[2]))),
    "dropout": _dropout,
    "sum": lambda v, a, place: _finish(v, reduce_local("sum", a[0], v.attrs["dims"], v.attrs["keepdim"])),
    "max": lambda v, a, place: _finish(v, reduce_local("max", a[0], v.attrs["dims"], v.attrs["keepdim"])),
    "min": lambda v, a, place: _finish(v, reduce_local("min", a[0], v.attrs["dims"], v.attrs["keepdim"])),
    "norm": lambda v, a, place: _finish(v, reduce_local("norm", a[0], v.attrs["dims"], v.attrs["keepdim"])),
    "matmul": lambda v, a, place: _finish(v, torch.matmul(a[0].float(), a[1].float())),
    "grouped_matmul": lambda v, a, place: _finish(v, grouped_matmul(a[0].float(), a[1].float(), a[2], v.name)),
    "grouped_matmul_wgrad": lambda v, a, place: _finish(v, grouped_matmul_wgrad(a[0].float(), a[1].float(), a[2],
                                                                                v.name)),
    "layer_norm": _layer_norm,
    "slice": lambda v, a, place: align(v.args[0], a[0], v, place),
}


def compute(v: Value, args: list[Any], place: Place) -> Any:
    """Result of computation `v` on one rank, given its operands' local values."""
    d = R.opdef(v.op)
    if d.meaning is None:
        raise NotImplementedError(f"no local semantics for operation {v.op!r}")
    if d.elementwise or d.group == R.NORMALISATION:  # operands line up with the result's part
        args = [align(a, t, v, place) for a, t in zip(v.args, args)]
    return d.meaning(v, args, place)


for _name, _meaning in MEANINGS.items():
    R.set_meaning(_name, _meaning)
