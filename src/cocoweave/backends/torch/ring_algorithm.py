"""The ring algorithm's collectives on the torch backend (ring.py): synchronous rings of point-to-point messages,
and CoCoNet's fused RS-C-AG. Registered against the table of collective algorithms below; generated code calls
each by name (`ctx.ring_all_reduce(...)`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import collectives
from ...ir.layout import slice_bounds
from . import ring
from .ring import parts, with_dim
from .runtime import RankContext


def ring_all_reduce(ctx: RankContext, x: torch.Tensor, op: str, group: Any, out: Any) -> torch.Tensor:
    """A ring reduce-scatter then a ring all-gather of the flattened tensor (balanced parts)."""
    if (alone := ctx.alone(x, out, False, group=group)) is not None:
        return alone
    res = ctx.buffer(out, x.shape, x.dtype)
    flat = x.reshape(-1)
    start, stop = slice_bounds(flat.numel(), dist.get_world_size(group), dist.get_rank(group))
    part = ctx.buffer((out, "part"), (stop - start,), x.dtype)
    ring.ring_reduce_scatter(flat, 0, op, group, part)
    ring.ring_all_gather(part, 0, group, res.view(-1))
    return res


def ring_reduce_scatter(ctx: RankContext, x: torch.Tensor, op: str, dim: int, group: Any, out: Any,
                        shares: Sequence[int] | None = None) -> torch.Tensor:
    if (alone := ctx.alone(x, out, False, group=group)) is not None:
        return alone
    start, stop = parts(x.shape[dim], dist.get_world_size(group), shares)[dist.get_rank(group)]
    res = ctx.buffer(out, with_dim(x.shape, dim, stop - start), x.dtype)
    ring.ring_reduce_scatter(x, dim, op, group, res, shares)
    return res


def ring_all_gather(ctx: RankContext, x: torch.Tensor, dim: int, total: int, group: Any, out: Any,
                    into: torch.Tensor | None = None, deferrable: bool = False,
                    shares: Sequence[int] | None = None) -> torch.Tensor:
    if (alone := ctx.alone(x, out, False, into, group)) is not None:
        return alone
    res = into if into is not None else ctx.buffer(out, with_dim(x.shape, dim, total), x.dtype)
    ring.ring_all_gather(x, dim, group, res, shares)
    return res


def fused_ring(ctx: RankContext, x: torch.Tensor, dim: int, op: str, group: Any,
               compute: Callable[[torch.Tensor, tuple[int, int]], tuple[list, list]],
               gathered: Sequence[tuple[Any, Sequence[int], torch.dtype]],
               kept: Sequence[tuple[Any, Sequence[int], torch.dtype]],
               subchunks: int = 2, shares: Sequence[int] | None = None) -> tuple[list[torch.Tensor],
                                                                                list[torch.Tensor]]:
    """CoCoNet's fused RS-C-AG (ring.fused_ring). `compute(piece, (offset, length))` returns the
    piece of every gathered output and of every kept value (this rank's part, assembled here)."""
    outs = [ctx.buffer(key, shape, dtype) for key, shape, dtype in gathered]
    keep = [ctx.buffer(key, shape, dtype) for key, shape, dtype in kept]

    def piece(reduced: torch.Tensor, offset: int, length: int) -> list[torch.Tensor]:
        results, parts = compute(reduced, (offset, length))
        for buf, part in zip(keep, parts):
            buf.narrow(dim, offset, length).copy_(part)
        return [r.expand(*with_dim(o.shape, dim, length)) for r, o in zip(results, outs)]

    if not dist.is_initialized():  # one rank alone: its tensor is the reduced whole, a single piece
        for o, r in zip(outs, piece(x, 0, x.shape[dim])):
            o.copy_(r)
        return outs, keep
    ring.fused_ring(x, dim, op, group, piece, outs, subchunks, shares)
    return outs, keep

collectives.implement("torch", "ring", all_reduce=ring_all_reduce, reduce_scatter=ring_reduce_scatter,
                      all_gather=ring_all_gather, fused=fused_ring)
