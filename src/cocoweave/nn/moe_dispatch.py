"""The one communication primitive of the MoE layer: an autograd-aware all-to-all of rows with uneven splits, and
the all-to-all of the split counts that precedes it. Kept in one place so that it can later be routed to the DSL's
`all_to_all` (issue #47 items 1 and 3) without touching the layer.

    recv_counts = exchange_counts(counts, group)                 # counts: (ranks, k) int64, row j for rank j
    y = dispatch_all_to_all(x, in_splits, out_splits, group)     # rows [sum(in[:j]), +in[j]) go to rank j
    buf, pending = start_all_to_all(x, in_splits, out_splits, group)   # the same, in flight: compute here,
    y = wait_all_to_all(buf, pending)                                  # then wait (backward: the reverse)

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


def _issue(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any, async_op: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Send `x`'s rows by `in_splits`, receive `out_splits`: (the receive buffer, the tensor sent, the work handle
    when `async_op`; both tensors must stay alive until it completes)."""
    send = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, send, out_splits, in_splits, group=group, async_op=async_op)
    return out, send, work


def _all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> torch.Tensor:
    return _issue(x, in_splits, out_splits, group)[0]


class Pending:
    """An all_to_all in flight: its work handle and the tensors it reads and writes (alive until the wait); the
    same for its backward's."""

    __slots__ = ("grad_out", "grad_send", "grad_work", "send", "work")

    def __init__(self) -> None:
        self.work = self.send = self.grad_work = self.grad_out = self.grad_send = None


class _Start(torch.autograd.Function):
    """Issue the all_to_all (async) and return its receive buffer, not to be read before `_Wait`. Backward: wait
    for the gradient's all_to_all that `_Wait`'s backward issued and return what it received."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any,
                pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        out, pending.send, pending.work = _issue(x, in_splits, out_splits, group, async_op=True)
        return out

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        p = ctx.pending
        p.grad_work.wait()
        grad, p.grad_out, p.grad_send, p.grad_work = p.grad_out, None, None, None
        return grad, None, None, None, None


class _Wait(torch.autograd.Function):
    """Wait for `_Start`'s all_to_all and return the rows received. Backward: issue the gradient's all_to_all
    (async, the splits swapped); autograd runs the nodes recorded between the start and the wait (later sequence
    numbers first) before `_Start`'s backward waits for it."""

    @staticmethod
    def forward(ctx: Any, buf: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any,
                pending: Pending) -> torch.Tensor:
        pending.work.wait()
        pending.work = pending.send = None
        ctx.splits, ctx.group, ctx.pending = (in_splits, out_splits), group, pending
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        in_splits, out_splits = ctx.splits
        p = ctx.pending
        p.grad_out, p.grad_send, p.grad_work = _issue(grad, out_splits, in_splits, ctx.group, async_op=True)
        return grad, None, None, None, None  # a placeholder: _Start's backward returns what the all_to_all got


def start_all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any
                     ) -> tuple[torch.Tensor, Any]:
    """`dispatch_all_to_all` split in two: issue it and return (the receive buffer, the pending operation); run
    other work, then `wait_all_to_all(buf, pending)` for the rows. Differentiable: the backward's all_to_all is in
    flight while autograd runs the backward of the nodes recorded between this call and the wait."""
    pending = Pending()
    in_splits, out_splits = list(in_splits), list(out_splits)
    pending_call = (in_splits, out_splits, group, pending)
    return _Start.apply(x, *pending_call), pending_call


def wait_all_to_all(buf: torch.Tensor, pending: Any) -> torch.Tensor:
    """The rows of `start_all_to_all`'s operation, once received."""
    return _Wait.apply(buf, *pending)


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


def no_start(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> tuple[torch.Tensor, Any]:
    """The floor's `start_all_to_all`: nothing in flight, the rows stay where they are."""
    return x, None


def no_wait(buf: torch.Tensor, pending: Any) -> torch.Tensor:
    """The floor's `wait_all_to_all`."""
    return buf


def no_exchange(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """The communication-free floor's count exchange: this rank's own counts."""
    return counts


__all__ = ["dispatch_all_to_all", "exchange_counts", "no_dispatch", "no_exchange", "no_start", "no_wait",
           "start_all_to_all", "wait_all_to_all"]
