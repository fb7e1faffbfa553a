"""The MoE layer's experts through the checked dropless programs (`MoE(..., experts_schedule=...)`): dispatch,
grouped SwiGLU and combine run as the compiled forward program (nn/programs.moe_forward, workloads.moe_dropless)
and its gradients as the backward program, inside one autograd function; the router, the row sort, the counts
exchange, the weighting and the shared expert stay in torch (nn/moe.py).

The ranks must run the same programs, whose shapes are static, while the rows a rank sends (capacity drops) and
receives (routing) are runtime values: `agreed_sizes` takes the maximum of both over the ranks (one small max
all-reduce, on shared memory where the ranks share a host) and rounds the rows sent up to a quarter of the most a
rank can send (tokens x top_k), the receive capacity up to a quarter of those; rows past the segments are zero
padding that the GEMMs skip, so a layer compiles at most 4 x (4 ep + 1) programs of each kind, and one step's are
reused by the next unless its load moves by more than a quarter.
"""

from __future__ import annotations

from typing import Any

import torch

from ..group_facts import max_flags
from ..ir.types import canonical_dtype
from ..workloads.experts import SAVED  # what the forward program outputs for the backward one
from . import programs as P


def capacity(rows: int, bound: int) -> int:
    """`rows` rounded up to a multiple of a quarter of `bound` (at least one quarter)."""
    step = max(1, bound // 4)
    return max(step, -(-rows // step) * step)


def agreed_sizes(rows: int, bound: int, received: torch.Tensor, group: Any, slots: Any) -> tuple[int, int, Any]:
    """(the rows every rank's programs take, their receive capacity, the slots for the next call): the maximum over
    `group`'s ranks (None: this rank alone) of the rows sent, rounded up to a quarter of `bound` (the most a rank
    sends), and of the rows received, rounded up to a quarter of that."""
    mine = torch.tensor([rows, int(received.sum())], dtype=torch.int32)
    top, slots = (mine, slots) if group is None else max_flags(group, mine, slots)
    n = capacity(int(top[0]), bound)
    return n, capacity(int(top[1]), n), slots


class DroplessExperts(torch.autograd.Function):
    """rows (sorted by global expert: by destination rank, then local expert) -> the local experts' outputs back
    in the same order, through moe_forward; backward through moe_backward. `sent` and `received` [ep, E / ep]: the
    rows sent to each rank for each of its experts, and received from each rank for each of ours; `sizes` the
    programs' rows and receive capacity (`agreed_sizes`: the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                sent: torch.Tensor, received: torch.Tensor, sizes: tuple[int, int], programs: Any) -> torch.Tensor:
        ranks, per = received.shape
        n, dim = rows.shape
        shape = (ranks, ranks * per, sizes[0], dim, w1.shape[2], sizes[1], canonical_dtype(rows.dtype))
        counts = {"s": sent.sum(1), "r": received.sum(1), "c": received}
        x = rows if n == sizes[0] else torch.cat([rows, rows.new_zeros(sizes[0] - n, dim)])
        y, *saved = programs.run("experts forward", P.moe_forward(*shape), {
            "x": x.contiguous(), **counts, "w1": w1, "w3": w3, "w2": w2}, rows.device, ("y", *SAVED))
        ctx.save_for_backward(*saved, w1, w2, w3)
        ctx.shape, ctx.counts, ctx.programs, ctx.n = shape, counts, programs, n
        return y[:n]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        *saved, w1, w2, w3 = ctx.saved_tensors
        n, rows = ctx.n, ctx.shape[2]
        g = grad if n == rows else torch.cat([grad, grad.new_zeros(rows - n, grad.shape[1])])
        inputs = {"g": g.contiguous(), **ctx.counts, **dict(zip(SAVED, saved)),
                  "w1t": w1.transpose(1, 2), "w3t": w3.transpose(1, 2), "w2t": w2.transpose(1, 2)}
        dx, gw1, gw2, gw3 = ctx.programs.run("experts backward", P.moe_backward(*ctx.shape), inputs, grad.device,
                                             ("dx", "gw1", "gw2", "gw3"))
        return dx[:n], gw1, gw2, gw3, None, None, None, None


__all__ = ["DroplessExperts", "agreed_sizes", "capacity"]
