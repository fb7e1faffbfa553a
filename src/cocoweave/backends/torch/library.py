"""The library algorithm's collectives on the torch backend: torch.distributed's call for every collective kind
(asynchronous where asked, chunked under overlap) and point-to-point send. Each is a function of the rank's
`RankContext` (its buffers, groups and early or provided results) registered against the table of collective
algorithms below; generated code calls it by name (`ctx.all_reduce(...)`).

Uneven splits (torch.tensor_split sizes, or parts in proportion to `shares`) are handled by padding every part to
the largest one, so the library's equal-size reduce_scatter / all_gather apply; when the split is even along dim 0
the tensors are used as they are, without copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import collectives
from ...errors import InputError
from ...ir.ops import row_counts
from . import runtime
from .ring import parts, with_dim
from .runtime import _REDUCE, RankContext


def all_reduce(ctx: RankContext, x: torch.Tensor, op: str, group: Any, out: Any, async_op: bool = False) -> Any:
    if (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone
    n = dist.get_world_size(group)
    if op == "adasum":  # synchronous: point-to-point rounds
        res = _adasum(ctx, x, group, out)
        return ctx.done(None, lambda: res, async_op)
    wire = ctx.wire(x)
    key = (out, "wire") if wire is not x else out
    buf = ctx.buffer(key, wire.shape, wire.dtype)
    buf.copy_(wire)
    reduce_op, divide = ctx._reduce_op(op, buf)
    work = dist.all_reduce(buf, reduce_op, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        if divide:
            buf.div_(n)
        if buf.dtype == x.dtype:
            return buf
        res = ctx.buffer(out, x.shape, x.dtype)
        res.copy_(buf)
        return res

    return ctx.done(work if async_op else None, finish, async_op)


def _adasum(ctx: RankContext, x: torch.Tensor, group: Any, out: Any) -> torch.Tensor:
    """Adasum by vector-halving, distance-doubling over P2P (backends/torch/adasum.py): bandwidth
    like a ring all-reduce, combining in exactly the reference's order on any group size."""
    from .adasum import adasum_all_reduce

    return adasum_all_reduce(x, group, ctx.buffer(out, x.shape, x.dtype))


def reduce_scatter(ctx: RankContext, x: torch.Tensor, op: str, dim: int, group: Any, out: Any,
                   async_op: bool = False, shares: Sequence[int] | None = None) -> Any:
    if (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone
    n, me = dist.get_world_size(group), dist.get_rank(group)
    size = x.shape[dim]
    bounds = parts(size, n, shares)
    c = max(stop - start for start, stop in bounds)
    wire = ctx.wire(x).movedim(dim, 0)
    rest = tuple(wire.shape[1:])
    mine = bounds[me][1] - bounds[me][0]
    if shares is not None and ctx.backend == "gloo":  # Gloo reduces uneven parts as they are: no padding
        part = ctx.buffer((out, "part"), (mine, *rest), wire.dtype)
        pieces = [wire[start:stop].contiguous() for start, stop in bounds]
        work = dist.reduce_scatter(part, pieces, op=_REDUCE[op], group=group, async_op=async_op)
        return ctx.done(work if async_op else None, _scattered(ctx, x, dim, mine, part, op, n, out), async_op)
    if size % n == 0 and dim == 0 and wire.is_contiguous() and shares is None:
        inp = wire
    else:  # pad each rank's segment to c rows so that equal-size reduce_scatter applies
        inp = ctx.buffer((out, "in"), (c * n, *rest), wire.dtype)
        for r, (start, stop) in enumerate(bounds):
            inp[r * c:r * c + stop - start].copy_(wire[start:stop])
    part = ctx.buffer((out, "part"), (c, *rest), wire.dtype)
    reduce_op, divide = ctx._reduce_op(op, part)
    work = runtime._REDUCE_SCATTER(part, inp, op=reduce_op, group=group, async_op=async_op)

    return ctx.done(work if async_op else None,
                      _scattered(ctx, x, dim, mine, part, "avg" if divide else "sum", n, out), async_op)


def _scattered(ctx: RankContext, x: torch.Tensor, dim: int, mine: int, part: torch.Tensor, op: str, n: int,
               out: Any) -> Callable[[], torch.Tensor]:
    """What completes a reduce_scatter: this rank's `mine` rows of `part` into its buffer, averaged for avg."""

    def finish() -> torch.Tensor:
        res = ctx.buffer(out, with_dim(x.shape, dim, mine), x.dtype)
        res.movedim(dim, 0).copy_(part[:mine])
        if op == "avg":
            res.div_(n)
        return res

    return finish


def all_gather(ctx: RankContext, x: torch.Tensor, dim: int, total: int, group: Any, out: Any, async_op: bool = False,
               into: torch.Tensor | None = None, deferrable: bool = False,
               shares: Sequence[int] | None = None) -> Any:
    """Gather the ranks' parts (tensor_split sizes, or in proportion to `shares`) of a tensor whose whole size
    along `dim` is `total` (into `into`, when given: a state tensor the result becomes). A deferrable gather is
    left in flight while the executable defers (its result is only read after Executable.wait)."""
    if (alone := ctx.alone(x, out, async_op, into, group)) is not None:
        return alone
    if deferrable and ctx.defer and not async_op:
        ctx.deferred.append(all_gather(ctx, x, dim, total, group, out, True, into, shares=shares))
        return into
    n = dist.get_world_size(group)
    bounds = parts(total, n, shares)
    sizes = [stop - start for start, stop in bounds]
    c = max(sizes)
    xt = x.movedim(dim, 0)
    rest = tuple(xt.shape[1:])
    full_shape = with_dim(x.shape, dim, total)
    res = into if into is not None else ctx.buffer(out, full_shape, x.dtype)
    if total % n == 0 and dim == 0 and x.is_contiguous() and res.is_contiguous() and shares is None:
        work = runtime._ALL_GATHER(res, x, group=group, async_op=async_op)
        return ctx.done(work if async_op else None, lambda: res, async_op)
    inp = ctx.buffer((out, "in"), (c, *rest), x.dtype)
    inp[:xt.shape[0]].copy_(xt)
    gathered = ctx.buffer((out, "gathered"), (c * n, *rest), x.dtype)
    work = runtime._ALL_GATHER(gathered, inp, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        rt = res.movedim(dim, 0)
        for r, (start, stop) in enumerate(bounds):
            rt[start:stop].copy_(gathered[r * c:r * c + stop - start])
        return res

    return ctx.done(work if async_op else None, finish, async_op)


def all_to_all(ctx: RankContext, x: torch.Tensor, src_dim: int, dim: int, total: int, group: Any, out: Any,
               async_op: bool = False, src_shares: Sequence[int] | None = None,
               shares: Sequence[int] | None = None) -> Any:
    """Move the slicing of a tensor from `src_dim` (whose whole size is `total`; this rank holds its part, in
    tensor_split sizes or in proportion to `src_shares`) to `dim` (parts likewise by `shares`): one
    all_to_all_single, each rank sending every other the piece of its part that rank keeps."""
    if (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone
    n, me = dist.get_world_size(group), dist.get_rank(group)
    sent = parts(x.shape[dim], n, shares)
    came = parts(total, n, src_shares)
    mine = sent[me][1] - sent[me][0]
    host = ctx.backend == "gloo" and x.device.type != "cpu"  # Gloo's all-to-all takes host tensors
    wire = x.detach().to("cpu") if host else x
    inp = ctx.buffer((out, "in"), (wire.numel(),), wire.dtype, wire.device)
    at = 0
    for start, stop in sent:  # the piece each rank keeps, one after the other
        piece = wire.narrow(dim, start, stop - start)
        inp[at:at + piece.numel()].view(piece.shape).copy_(piece)
        at += piece.numel()
    shapes = [with_dim(with_dim(x.shape, src_dim, stop - start), dim, mine) for start, stop in came]
    counts = [math.prod(sh) for sh in shapes]
    got = ctx.buffer((out, "got"), (sum(counts),), wire.dtype, wire.device)
    pieces = [math.prod(with_dim(wire.shape, dim, stop - start)) for start, stop in sent]
    work = dist.all_to_all_single(got, inp, counts, pieces, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        res = ctx.buffer(out, with_dim(with_dim(x.shape, src_dim, total), dim, mine), x.dtype)
        for (start, stop), piece, shape in zip(came, got.split(counts), shapes):
            res.narrow(src_dim, start, stop - start).copy_(piece.view(shape))
        return res

    return ctx.done(work if async_op else None, finish, async_op)


def all_to_all_v(ctx: RankContext, x: torch.Tensor, splits: torch.Tensor, recv: torch.Tensor, dim: int, rows: int,
                 group: Any, out: Any, async_op: bool = False, start: Callable[..., Any] | None = None) -> Any:
    """An all_to_all with runtime splits (ir/ops.py's all_to_all_v): this rank's first sum(splits) rows along `dim`,
    splits[j] to group rank j; recv[i] rows from rank i, in rank order, into a result of `rows` rows whose tail is
    zero. One all_to_all_single (`start(x, in_splits, out_splits, out)`, an object whose `.wait()` fills `out`,
    replaces it: shm_algorithm's shared-memory exchange); the counts are read on the host (a device sync
    for CUDA tensors)."""
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if n > 1 and (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone  # launched early (its counts checked then) or provided
    where = f"rank {ctx.rank}: all_to_all_v"
    sent, came = row_counts(splits, n, "splits", where), row_counts(recv, n, "recv", where)
    n_sent, n_came = sum(sent), sum(came)
    if n_sent > x.shape[dim] or n_came > rows:
        raise InputError(f"{where} sends {n_sent} of its {x.shape[dim]} rows and receives "
                         f"{n_came} into {rows}: the counts do not fit the tensors")
    res = ctx.buffer(out, with_dim(x.shape, dim, rows), x.dtype)
    rt = res.movedim(dim, 0)
    rt[n_came:].zero_()
    xt = x.movedim(dim, 0)[:n_sent]
    if n == 1:
        rt[:n_came].copy_(xt)
        return ctx.done(None, lambda: res, async_op)
    host = ctx.backend == "gloo" and x.device.type != "cpu"  # Gloo's all-to-all takes host tensors
    wire = (xt.detach().to("cpu") if host else xt).contiguous()
    direct = dim == 0 and not host and res.is_contiguous()  # received straight into the result
    got = rt[:n_came] if direct else ctx.buffer((out, "got"), (rows, *wire.shape[1:]), wire.dtype,
                                                wire.device)[:n_came]
    if start is not None:
        work = start(wire, sent, came, got)
    else:
        work = dist.all_to_all_single(got, wire, came, sent, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        if start is not None:
            work.wait()
        if not direct:
            rt[:n_came].copy_(got)
        return res

    return ctx.done(work if async_op or start is not None else None, finish, async_op)


def broadcast(ctx: RankContext, x: torch.Tensor, root: int, group: Any, out: Any, async_op: bool = False) -> Any:
    if (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone
    buf = ctx.buffer(out, x.shape, x.dtype)
    buf.copy_(x)
    src = dist.get_global_rank(group, root) if group is not None else root
    work = dist.broadcast(buf, src=src, group=group, async_op=async_op)
    return ctx.done(work if async_op else None, lambda: buf, async_op)


def reduce(ctx: RankContext, x: torch.Tensor, op: str, root: int, group: Any, out: Any, async_op: bool = False) -> Any:
    if (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone
    wire = ctx.wire(x)
    buf = ctx.buffer((out, "wire"), wire.shape, wire.dtype)
    buf.copy_(wire)
    dst = dist.get_global_rank(group, root) if group is not None else root
    work = dist.reduce(buf, dst=dst, op=_REDUCE[op], group=group, async_op=async_op)
    is_root = dist.get_rank(group) == root

    def finish() -> torch.Tensor:
        res = ctx.buffer(out, x.shape, x.dtype)
        if is_root:
            res.copy_(buf / dist.get_world_size(group) if op == "avg" else buf)
        else:
            res.copy_(x)  # the other ranks keep their own input
        return res

    return ctx.done(work if async_op else None, finish, async_op)


def send_recv(ctx: RankContext, x: torch.Tensor | None, peer: int, sending: bool, shape: Sequence[int],
              dtype: torch.dtype, out: Any, async_op: bool = False) -> Any:
    """Group rank i of the sending stage sends to group rank i of the receiving stage. Under Gloo a message
    crosses in host memory (its point-to-point takes no CUDA pointer: writev fails with 'Bad address')."""
    host = ctx.backend == "gloo" and ctx.device.type != "cpu"
    if sending:
        wire = x.detach().to("cpu") if host else x.contiguous()
        work = dist.isend(wire.contiguous(), dst=peer)
        return ctx.done(work, lambda: None, async_op)  # the work holds `wire` until the send completes
    buf = ctx.buffer(out, shape, dtype)
    if not host:
        return ctx.done(dist.irecv(buf, src=peer), lambda: buf, async_op)
    wire = ctx.buffer((out, "host"), shape, dtype, torch.device("cpu"))
    return ctx.done(dist.irecv(wire, src=peer), lambda: buf.copy_(wire), async_op)

collectives.implement("torch", collectives.DEFAULT, all_reduce=all_reduce, reduce_scatter=reduce_scatter,
                      all_gather=all_gather, all_to_all=all_to_all, all_to_all_v=all_to_all_v, broadcast=broadcast,
                      reduce=reduce, send=send_recv)
