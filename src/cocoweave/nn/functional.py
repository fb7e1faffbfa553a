"""Autograd functions of tensor parallelism (Megatron's f and g, gather and scatter) and the fused
bias + dropout + residual epilogue whose dropout mask is cocoweave's counter-based hash.

    f = copy_to_parallel:    forward identity,   backward all_reduce(sum)   (before a column-parallel matmul)
    g = reduce_from_parallel: forward all_reduce, backward identity          (after a row-parallel matmul)

The epilogue's mask depends only on (seed, logical element index): forward and backward recompute it
from those two numbers (nothing is stored), and a single-process model given the same seed and the same
logical indices draws the same mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import rng
from ..group_facts import group_rank, group_size
from ..ir.layout import slice_bounds
from ..ir.types import canonical_dtype
from . import programs as P
from .programs import ASYNC, ASYNC_SHM

Group = dist.ProcessGroup | None


def part(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Part `index` of `t` split in `parts` along `dim` (torch.tensor_split sizes, like the DSL's Sliced)."""
    start, stop = slice_bounds(t.shape[dim], parts, index)
    return t.narrow(dim, start, stop - start)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def all_gather_cat(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` (equal shapes) along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_cat(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return part(grad, ctx.dim, group_size(ctx.group), group_rank(ctx.group)).contiguous(), None, None


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return part(x, dim, group_size(group), group_rank(group)).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_cat(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's f: identity forward; the backward sums the gradient over `group`."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's g: all_reduce(sum) of partial results forward; identity backward."""
    return _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, dim: int = -1, group: Group = None) -> torch.Tensor:
    """All-gather equal slices along `dim` forward; the backward keeps this rank's slice of the gradient."""
    return _GatherFromParallel.apply(x, dim % x.dim(), group)


def scatter_to_parallel(x: torch.Tensor, dim: int = -1, group: Group = None) -> torch.Tensor:
    """Keep this rank's slice along `dim` forward; the backward all-gathers the gradient."""
    return _ScatterToParallel.apply(x, dim % x.dim(), group)


# ---------------------------------------------------------------------------------------------------------
# The fused epilogue: out = dropout(y + bias, p, seed) + residual
# ---------------------------------------------------------------------------------------------------------


def _dropout(x: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """rng.dropout of `x` whose element i sits at logical index offset + i (row-major)."""
    index = torch.arange(offset, offset + x.numel(), dtype=torch.int64, device=x.device).reshape(x.shape)
    return rng.dropout(x, index, p, seed)


def epilogue_forward(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, p: float,
                     seed: int, offset: int, kernel: bool | None = None) -> torch.Tensor:
    """dropout(y + bias) + residual without autograd: the Triton kernel (`kernel`, default: on CUDA when there
    is a residual, dropout and a row-aligned offset: one read of y and residual, one write), else torch ops."""
    L = y.shape[-1] if y.dim() else 1
    if kernel is None:
        kernel = y.is_cuda and residual is not None and p > 0 and offset % L == 0
    if kernel and residual is not None:
        from ..kernels.epilogue import bias_dropout_residual as triton_epilogue

        y2 = y.contiguous().reshape(-1, L)
        first = offset // L  # the logical row where y starts
        out = triton_epilogue(y2, None if bias is None else bias.contiguous(), residual.contiguous().reshape(-1, L),
                              p, seed, dim=0, offset=first, full_size=first + y2.shape[0])
        return out.view(y.shape)
    out = y if bias is None else y + bias
    if p > 0:
        out = _dropout(out, p, seed, offset)
    return out if residual is None else out + residual


class _BiasDropoutResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, p: float,
                seed: int, offset: int) -> torch.Tensor:
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        return epilogue_forward(y, bias, residual, p, seed, offset)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gy = epilogue_grad(grad, ctx.p, ctx.seed, ctx.offset)
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias else None
        return gy, gb, grad if ctx.has_residual else None, None, None, None


def epilogue_grad(grad: torch.Tensor, p: float, seed: int, offset: int = 0) -> torch.Tensor:
    """Gradient of the epilogue's input given its output's: the same mask, recomputed, times 1/(1-p)."""
    return _dropout(grad, p, seed, offset)


def mix_seed(*parts: int) -> int:
    """One 32-bit dropout seed from several integers (a base seed, a step, a layer), by chained triple32."""
    h = 0
    for x in parts:
        h = rng.triple32_int(h ^ (int(x) & rng.MASK32))
    return h


def bias_dropout_residual(y: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                          p: float = 0.0, seed: int = 0, offset: int = 0, training: bool = True) -> torch.Tensor:
    """dropout(y + bias, p, seed) + residual in one step; element i of y has logical index offset + i
    (row-major), so a shard of a larger logical tensor draws that tensor's mask. No dropout unless training."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return _BiasDropoutResidual.apply(y, bias, residual, p if training else 0.0, int(seed), int(offset))


# ---------------------------------------------------------------------------------------------------------
# The layers as cocoweave programs (nn/programs.py), run by a layer's compiled executables (nn/compiled.py)
# ---------------------------------------------------------------------------------------------------------


def _scalars(p: float, seed: int, offset: int) -> dict[str, int]:
    return {"seed": seed, "offset": offset} if p > 0 else {}


class _RowProgram(torch.autograd.Function):
    """The row-parallel layer through its forward and backward programs (with `sp`, its output and residual are
    this rank's token slice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None, p: float, seed: int, offset: int, programs: Any, d_in: int,
                sp: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        d_out = weight.shape[0]
        prog = P.row_forward(x2.shape[0], d_in, d_out, _dtype(x), p, bias is not None, residual is not None, sp)
        inputs = {"x": x2, "w": weight.t(), **_scalars(p, seed, offset)}
        if bias is not None:
            inputs["b"] = bias
        if residual is not None:
            inputs["r"] = residual.reshape(-1, d_out)
        out, = programs.run("forward", prog, inputs, x.device, ("out",))
        ctx.save_for_backward(x, weight)
        ctx.p, ctx.seed, ctx.offset, ctx.programs, ctx.d_in, ctx.sp = p, seed, offset, programs, d_in, sp
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        return out if sp else out.view(*x.shape[:-1], d_out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        d_out = weight.shape[0]
        prog = P.row_backward(x2.shape[0], ctx.d_in, d_out, _dtype(x), ctx.p, ctx.has_bias, ctx.sp)
        g = grad.reshape(-1, d_out)
        inputs = {"g": g, "w": weight, **_scalars(ctx.p, ctx.seed, ctx.offset)}
        names = ("gx", "gb") if ctx.has_bias else ("gx",)
        if any(n == "gy" for n, _ in prog.outputs):
            names += ("gy",)
        got = dict(zip(names, ctx.programs.run("backward", prog, inputs, x.device, names), strict=True))
        gw = got.get("gy", g).t() @ x2  # (out, in): the weight gradient's own layout, no copy in autograd
        return (got["gx"].view(x.shape), gw, got.get("gb"), grad if ctx.has_residual else None,
                None, None, None, None, None, None)


class _ColumnProgram(torch.autograd.Function):
    """The column-parallel layer: forward x Wᵀ + b (with `sp`, this rank's token slice all-gathered first, by a
    program); backward through the input-gradient program (all-reduce, or with `sp` reduce-scatter), or with the
    ASYNC schedule the reduction launched and the weight gradient computed while it is in flight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, programs: Any,
                out_features: int, rows: int, sp: bool) -> torch.Tensor:
        if sp:
            prog = P.column_forward_sp(rows, weight.shape[1], out_features, _dtype(x))
            y, xg = programs.run("forward", prog, {"x": x.reshape(-1, weight.shape[1]), "w": weight.t()}, x.device,
                                 ("y", "xg"))
            y = y if bias is None else y.add_(bias)
        else:
            xg = x.reshape(-1, weight.shape[1])
            y = F.linear(xg, weight, bias)
        ctx.save_for_backward(xg, weight)
        ctx.programs, ctx.out_features, ctx.sp, ctx.has_bias, ctx.shape = programs, out_features, sp, \
            bias is not None, x.shape
        return y if sp else y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:

        xg, weight = ctx.saved_tensors
        gy = grad.reshape(-1, weight.shape[0])
        rows, d_in = xg.shape
        programs = ctx.programs
        prog = P.column_backward(rows, d_in, ctx.out_features, _dtype(xg), ctx.has_bias, ctx.sp)

        def as_program() -> tuple[Any, ...]:
            names = ("gx", "gw", "gb") if ctx.has_bias else ("gx", "gw")
            got = programs.run("backward", prog, {"gy": gy, "gyt": gy.t(), "w": weight, "x": xg}, xg.device, names)
            return got[0], got[1], got[2] if ctx.has_bias else None

        def overlapped() -> tuple[Any, ...]:  # Megatron's asynchronous input-gradient all-reduce
            partial = gy @ weight
            exe = programs.launch("backward", P.grad_all_reduce(rows, d_in, _dtype(xg), ctx.sp), {"g": partial},
                                  xg.device)
            gw = gy.t() @ xg  # while the input gradient's reduction is in flight
            gb = gy.sum(0) if ctx.has_bias else None
            return exe.release(exe.run({"g": partial}).outputs["gx"]), gw, gb

        def overlapped_shm() -> tuple[Any, ...]:  # ASYNC on shared memory: the weight gradient fills the wait
            gx = torch.empty(rows, d_in, dtype=gy.dtype, device=gy.device)
            posted = programs.posted_all_reduce(gx)
            if posted is None:  # the group does not share this host's memory (the same on every rank)
                return as_program()
            torch.matmul(gy, weight, out=posted.slot.view(rows, d_in))  # this rank's partial sum, in its slot
            posted.arrive()
            # a rank that arrived first computes these while the others arrive; nobody waits for this rank's reads
            # (the slots alternate), so it reduces only when it needs the sum
            gw = gy.t() @ xg
            gb = gy.sum(0) if ctx.has_bias else None
            return posted.finish(), gw, gb

        routes = {"program": as_program, ASYNC: overlapped}
        if not ctx.sp:
            routes[ASYNC_SHM] = overlapped_shm
        gx, gw, gb = routes[programs.route("backward", prog, routes, xg.device)]()
        return gx.view(ctx.shape), gw, gb, None, None, None, None


def _dtype(t: torch.Tensor) -> str:
    return canonical_dtype(t.dtype)


def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                 p: float, seed: int, offset: int, programs: Any, in_features: int,
                 sequence_parallel: bool = False) -> torch.Tensor:
    """dropout(all_reduce(x Wᵀ) + b) + residual through the layer's compiled programs (see RowParallelLinear)."""
    return _RowProgram.apply(x, weight, bias, residual, p, int(seed), int(offset), programs, in_features,
                             sequence_parallel)


def column_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, programs: Any,
                    out_features: int, rows: int = 0, sequence_parallel: bool = False) -> torch.Tensor:
    """x Wᵀ + b with the input gradient reduced by the layer's compiled programs (see ColumnParallelLinear)."""
    return _ColumnProgram.apply(x, weight, bias, programs, out_features, rows, sequence_parallel)


class _SumGrads(torch.autograd.Function):
    """Identity forward on several tensors; the backward sums their gradients over the group in ONE program run
    (the gradients side by side): LayerNorm parameters that see only this rank's tokens under sequence parallelism."""

    @staticmethod
    def forward(ctx: Any, programs: Any, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.programs, ctx.shapes = programs, [t.shape for t in ts]
        return tuple(t.view_as(t) for t in ts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        flat = torch.cat([g.reshape(1, -1) for g in grads], dim=1)
        prog = P.grad_all_reduce(1, flat.shape[1], _dtype(flat))
        summed, = ctx.programs.run("parameter grads", prog, {"g": flat}, flat.device, ("gx",))
        return (None, *(s.view(shape) for s, shape in zip(summed.split([g.numel() for g in grads], dim=1),
                                                            ctx.shapes, strict=True)))


def sum_grads(programs: Any, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`ts` unchanged; their gradients summed over the layer's group by its compiled programs (one collective)."""
    return _SumGrads.apply(programs, *ts)
