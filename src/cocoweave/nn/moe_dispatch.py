"""The one communication primitive of the MoE layer: an autograd-aware all-to-all of rows with uneven splits, and
the all-to-all of the split counts that precedes it. Kept in one place so that it can later be routed to the DSL's
`all_to_all` (issue #47 items 1 and 3) without touching the layer.

    recv_counts = exchange_counts(counts, group)                 # counts: (ranks, k) int64, row j for rank j
    y = dispatch_all_to_all(x, in_splits, out_splits, group)     # rows [sum(in[:j]), +in[j]) go to rank j

The backward of a dispatch is the dispatch of the gradient with the splits swapped (the combine). Both run
`torch.distributed.all_to_all_single`, which takes uneven splits, zeros included, on Gloo and NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any
                ) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _all_to_all(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        in_splits, out_splits = ctx.splits
        return _all_to_all(grad, out_splits, in_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def dispatch_all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> torch.Tensor:
    """Rows of `x` to the ranks of `group`: the first in_splits[0] rows to rank 0, the next in_splits[1] to rank 1,
    ...; returns the rows received, out_splits[j] of them from rank j, in rank order. Differentiable."""
    return _AllToAll.apply(x, list(in_splits), list(out_splits), group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """`counts` (ranks, k) int64, row j what this rank sends to rank j; returns (ranks, k), row j what rank j sends
    to this rank (one all_to_all of ranks x k integers)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def no_dispatch(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> torch.Tensor:
    """The communication-free floor's dispatch: the rows stay where they are (out_splits must equal in_splits)."""
    return x


def no_exchange(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """The communication-free floor's count exchange: this rank's own counts."""
    return counts


__all__ = ["dispatch_all_to_all", "exchange_counts", "no_dispatch", "no_exchange"]
