"""What every computation does on one rank's local tensors, in plain torch ops.

This is the meaning of the DSL's computations; the reference backend and the torch backend's CPU
path both call it. Half-precision values are computed in float32 and rounded once per operation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import rng
from ..ir.graph import Value
from ..ir.layout import slice_bounds
from ..ir.types import DTYPES, bind_shape

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RankContext:
    """Where a rank sits: its index and size within the value's process group, and bound sizes."""

    group_rank: int
    group_size: int
    sizes: Mapping[str, int]
    chunk: tuple[int, int, int, int] | None = None  # (dim, ndim of the chain, start, length) when chunked


def align(arg: Value, t: Any, out: Value, ctx: RankContext) -> Any:
    """Slice a Replicated operand to this rank's part when the result is Sliced (Replicated with
    Sliced gives Sliced): along the aligned dimension, unless that dimension is broadcast (size 1)."""
    if not out.layout.is_sliced or arg.is_scalar or not arg.layout.is_replicated:
        return t
    j = out.layout.dim - (out.ndim - arg.ndim)
    if j < 0 or t.shape[j] == 1:
        return t
    return _own_part(t, j, ctx)


def _own_part(t: torch.Tensor, dim: int, ctx: RankContext) -> torch.Tensor:
    start, stop = slice_bounds(t.shape[dim], ctx.group_size, ctx.group_rank)
    return t.narrow(dim, start, stop - start)


def _up(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF else t


def _finish(v: Value, r: Any) -> Any:
    """Round a result to the value's dtype (scalars stay float64 host numbers)."""
    if v.is_scalar:
        return r if isinstance(r, torch.Tensor) else torch.tensor(r, dtype=torch.float64)
    dt = DTYPES[v.dtype]
    return r.to(dt) if r.dtype != dt else r


_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
}
_UNARY = {"neg": torch.neg, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "exp": torch.exp, "abs": torch.abs}


def dropout_index(v: Value, local_shape: tuple[int, ...], ctx: RankContext, device: torch.device) -> torch.Tensor:
    """Logical element indices of this rank's part of dropout's operand (rank-independent for
    Replicated; the rank's slice for Sliced; the full index for Local, whose key adds the rank)."""
    x = v.args[0]
    full = bind_shape(x.shape, ctx.sizes)
    idx = rng.logical_index(full, device)
    if x.layout.is_sliced:
        d = x.layout.dim
        start, stop = slice_bounds(full[d], ctx.group_size, ctx.group_rank)
        idx = idx.narrow(d, start, stop - start)
    if ctx.chunk is not None:
        dim, nd, start, length = ctx.chunk
        j = dim - (nd - x.ndim)
        if j >= 0 and idx.shape[j] != 1:
            idx = idx.narrow(j, start, length)
    assert tuple(idx.shape) == tuple(local_shape), (idx.shape, local_shape)
    return idx


def compute(v: Value, args: list[Any], ctx: RankContext) -> Any:
    """Result of computation `v` on one rank, given its operands' local values."""
    op = v.op
    if op == "const":
        return torch.tensor(v.attrs["value"], dtype=torch.float64 if isinstance(v.attrs["value"], float)
                            else torch.int64)
    if op not in ("matmul", "slice"):  # elementwise-style operands line up with the result's slice
        args = [align(a, t, v, ctx) for a, t in zip(v.args, args)]
    if op in _BINARY:
        return _finish(v, _BINARY[op](_up(args[0]), _up(args[1])))
    if op in _UNARY:
        x = args[0]
        if op in ("sqrt", "rsqrt", "exp") and not torch.is_floating_point(x):
            x = x.double() if v.is_scalar else x.float()
        return _finish(v, _UNARY[op](_up(x)))
    if op == "cast":
        return args[0].to(DTYPES[v.dtype])
    if op == "slice":
        return _own_part(args[0], v.attrs["dim"], ctx)
    if op == "where":
        return _finish(v, torch.where(args[0], _up(args[1]), _up(args[2])))
    if op == "dropout":
        seed = v.attrs["seed"] if v.attrs["seed"] is not None else int(args[1])
        x = args[0]
        rank = ctx.group_rank if v.args[0].layout.is_local else rng.NO_RANK
        idx = dropout_index(v, tuple(x.shape), ctx, x.device)
        return _finish(v, rng.dropout(_up(x), idx, v.attrs["p"], seed, rank))
    if op in ("sum", "max", "min", "norm"):
        return _finish(v, reduce_local(op, args[0], v.attrs["dims"], v.attrs["keepdim"]))
    if op == "matmul":
        return _finish(v, torch.matmul(args[0].float(), args[1].float()))
    if op == "layer_norm":
        x = args[0]
        w = args[1].float() if v.attrs["has_weight"] else None
        b = args[1 + v.attrs["has_weight"]].float() if v.attrs["has_bias"] else None
        return _finish(v, torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), w, b, v.attrs["eps"]))
    raise NotImplementedError(f"no local semantics for operation {op!r}")


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
