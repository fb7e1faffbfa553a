"""The shared-memory algorithm's collectives on the torch backend (shm.py): synchronous, between the ranks of one
host, CPU tensors only; where a group cannot use it (tensors off the CPU, ranks not proven to share the host, no
segment) the library's collective runs instead, with one warning. Registered against the table of collective
algorithms below; generated code calls each by name (`ctx.shm_all_reduce(...)`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import collectives
from . import library, shm, shm_all_to_all
from .ring import parts, with_dim
from .runtime import RankContext


def _rows(rows: int, row: int, n: int, shares: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(flat start, length) of each rank's part of a tensor of `rows` rows of `row` elements."""
    return [(start * row, (stop - start) * row) for start, stop in parts(rows, n, shares)]


def shm_all_reduce(ctx: RankContext, x: torch.Tensor, op: str, group: Any, out: Any, async_op: bool = False) -> Any:
    if (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone
    g = ctx._shm_group(group, x) if op != "adasum" else None
    wire = ctx.wire(x).reshape(-1)
    slots = None if g is None else ctx._shm_slots(g, out, wire.numel(), wire.dtype)
    if g is None or slots is None:
        return library.all_reduce(ctx, x, op, group, out, async_op)
    res = ctx.buffer((out, "wire") if wire.dtype != x.dtype else out, x.shape, wire.dtype)
    parts = _rows(wire.numel(), 1, g.size)
    shm.all_reduce(g, slots, wire if wire.is_contiguous() else wire.contiguous(), op, parts, res.view(-1))
    if res.dtype != x.dtype:
        res = ctx.buffer(out, x.shape, x.dtype).copy_(res)
    return ctx.done(None, lambda: res, async_op)


def shm_reduce_scatter(ctx: RankContext, x: torch.Tensor, op: str, dim: int, group: Any, out: Any,
                       async_op: bool = False, shares: Sequence[int] | None = None) -> Any:
    if (alone := ctx.alone(x, out, async_op, group=group)) is not None:
        return alone
    g = ctx._shm_group(group, x)
    wire = ctx.wire(x).movedim(dim, 0)
    flat = wire.reshape(-1) if wire.is_contiguous() else wire.contiguous().reshape(-1)
    slots = None if g is None else ctx._shm_slots(g, out, flat.numel(), flat.dtype)
    if g is None or slots is None:
        return library.reduce_scatter(ctx, x, op, dim, group, out, async_op, shares)
    rows = x.shape[dim]
    flat_parts = _rows(rows, flat.numel() // rows if rows else 0, g.size, shares)
    mine = parts(rows, g.size, shares)[g.me]
    shape = with_dim(x.shape, dim, mine[1] - mine[0])
    if dim == 0 and wire.dtype == x.dtype:  # reduced in place in this rank's slot: valid until it is written
        reduced = shm.reduce_scatter(g, slots, flat, op, flat_parts).view(shape)
        return ctx.done(None, lambda: reduced, async_op)
    part = ctx.buffer((out, "part"), (mine[1] - mine[0], *wire.shape[1:]), flat.dtype)
    shm.reduce_scatter(g, slots, flat, op, flat_parts, part.view(-1))
    res = ctx.buffer(out, shape, x.dtype)
    res.movedim(dim, 0).copy_(part)
    return ctx.done(None, lambda: res, async_op)


def shm_all_gather(ctx: RankContext, x: torch.Tensor, dim: int, total: int, group: Any, out: Any,
                   async_op: bool = False, into: torch.Tensor | None = None, deferrable: bool = False,
                   shares: Sequence[int] | None = None) -> Any:
    if (alone := ctx.alone(x, out, async_op, into, group)) is not None:
        return alone
    g = ctx._shm_group(group, x)
    if g is None:
        return library.all_gather(ctx, x, dim, total, group, out, async_op, into, deferrable, shares=shares)
    res = into if into is not None else ctx.buffer(out, with_dim(x.shape, dim, total), x.dtype)
    xt = x.movedim(dim, 0)
    flat = xt.reshape(-1) if xt.is_contiguous() else xt.contiguous().reshape(-1)
    row = flat.numel() // x.shape[dim] if x.shape[dim] else math.prod(xt.shape[1:])
    bounds = parts(total, g.size, shares)
    flat_bounds = [(a * row, (b - a) * row) for a, b in bounds]
    common = ctx.shm_buffers.commons.get((out, "whole"))
    if into is not None and dim == 0 and common is not None and into.data_ptr() == common[0].data_ptr():
        # the state is stored once for the group (Executable.shared_input): parts in place, one barrier
        shm.gather_common(g, common[0], flat_bounds, flat)
        return ctx.done(None, lambda: res, async_op)
    wholes = ctx.shm_buffers.slots.get((out, "whole"))
    if into is not None and dim == 0 and wholes is not None and into.data_ptr() == wholes[g.me].data_ptr():
        # the state lives in shared memory (Executable.shared_input): the others read this rank's part there
        shm.gather_in_place(g, wholes, flat_bounds, flat)
        return ctx.done(None, lambda: res, async_op)
    biggest = max(stop - start for start, stop in bounds)
    slots = ctx._shm_slots(g, out, biggest * row, x.dtype)
    if slots is None:
        return library.all_gather(ctx, x, dim, total, group, out, async_op, into, deferrable, shares=shares)
    rt_ = res.movedim(dim, 0)
    outs = [rt_[start:stop] for start, stop in bounds]
    if dim == 0 and res.is_contiguous():
        shm.all_gather(g, slots, flat, outs)
    else:  # gather flat pieces, then place them along `dim`
        tmp = [ctx.buffer((out, "piece", j), o.shape, x.dtype) for j, o in enumerate(outs)]
        shm.all_gather(g, slots, flat, tmp)
        for o, t in zip(outs, tmp):
            o.copy_(t)
    return ctx.done(None, lambda: res, async_op)


def shm_send_recv(ctx: RankContext, x: torch.Tensor | None, peer: int, sending: bool, shape: Sequence[int],
                  dtype: torch.dtype, out: Any, async_op: bool = False) -> Any:
    """Group rank i of the sending stage hands its tensor to group rank i of the receiving stage through shared
    memory (the library's send where the two do not share this host)."""
    if out not in ctx.pairs:
        sender, receiver = (ctx.rank, peer) if sending else (peer, ctx.rank)
        # both sides decide alike: on the host's memory only, and proven (or not) between the two through the store
        ctx.pairs[out] = shm.Pair.make(sender, receiver, str(out), math.prod(shape), dtype) \
            if ctx.device.type == "cpu" else None
    pair = ctx.pairs[out]
    if pair is None:
        return library.send_recv(ctx, x, peer, sending, shape, dtype, out, async_op)
    if sending:
        pair.send(x)
        return ctx.done(None, lambda: None, async_op)
    buf = pair.recv(ctx.buffer(out, shape, dtype))
    return ctx.done(None, lambda: buf, async_op)


def shm_all_to_all_v(ctx: RankContext, x: torch.Tensor, splits: torch.Tensor, recv: torch.Tensor, dim: int,
                     rows: int, group: Any, out: Any, async_op: bool = False) -> Any:
    """all_to_all_v through shm_all_to_all's slots (one copy out and one in per row, no socket); the library's
    all_to_all_single where the group cannot use shared memory."""
    g = ctx._shm_group(group, x) if dist.is_initialized() and dist.get_world_size(group) > 1 else None
    start = None if g is None else (lambda wire, sent, came, got: shm_all_to_all.start(g, group, wire, sent, came, got))
    return library.all_to_all_v(ctx, x, splits, recv, dim, rows, group, out, async_op, start=start)


collectives.implement("torch", "shm", all_reduce=shm_all_reduce, reduce_scatter=shm_reduce_scatter,
                      all_gather=shm_all_gather, all_to_all_v=shm_all_to_all_v, send=shm_send_recv)
