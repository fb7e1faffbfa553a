"""The one communication primitive of the MoE layer: an autograd-aware all-to-all of rows with uneven splits, and
the all-to-all of the split counts that precedes it. Kept in one place so that it can later be routed to the DSL's
`all_to_all` (issue #47 items 1 and 3) without touching the layer.

    recv_counts = exchange_counts(counts, group)                 # counts: (ranks, k) int64, row j for rank j
    y = dispatch_all_to_all(x, in_splits, out_splits, group)     # rows [sum(in[:j]), +in[j]) go to rank j
    buf, pending = start_all_to_all(x, in_splits, out_splits, group)   # the same, in flight: compute here,
    y = wait_all_to_all(buf, pending)                                  # then wait (backward: the reverse)

The backward of a dispatch is the dispatch of the gradient with the splits swapped (the combine). The route is
decided once per (group, device type) by group_facts.shared_memory (the one answer nn/compiled.py and the
optimizer ask too): ranks that share this host's memory (CPU tensors) exchange through shared memory
(backends/torch/shm_all_to_all.py: each rank writes the rows for the others into its slot, flags, and the others
read theirs; "async" means this rank computes between its write and its reads while its peers arrive); across
hosts, on CUDA, or with `library=True`, `torch.distributed.all_to_all_single` (uneven splits, zeros included, on
Gloo and NCCL; async on its own thread).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import group_facts

_ROUTES: dict[tuple[Any, str], Any] = {}  # (group, device type) -> its shared-memory group, None: the library's


def _route(group: Any, device: torch.device) -> Any:
    """The shared-memory group for `group`'s all-to-alls of tensors on `device`, or None for the library's: decided
    on the first call (a collective of the group then, on every rank at the same call) and kept."""
    key = (group, device.type)
    if key not in _ROUTES:
        _ROUTES[key] = group_facts.shared_memory(group, device)
    return _ROUTES[key]


class _Library:
    """torch.distributed.all_to_all_single of rows, in flight when `async_op`: `out` is the receive buffer, not to
    be read before `wait()`; the tensor sent stays alive until then."""

    __slots__ = ("out", "send", "work")

    def __init__(self, x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any,
                 async_op: bool) -> None:
        self.send = x.contiguous()
        self.out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.work = dist.all_to_all_single(self.out, self.send, out_splits, in_splits, group=group,
                                           async_op=async_op)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        self.work = self.send = None
        return self.out


def _issue(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any, library: bool,
           async_op: bool = False) -> Any:
    """Send `x`'s rows by `in_splits`, receive `out_splits`: the operation, whose `out` is the receive buffer and
    whose `wait()` returns it filled (through shared memory where `_route` says so, else the library's)."""
    g = None if library else _route(group, x.device)
    if g is None:
        return _Library(x, in_splits, out_splits, group, async_op)
    return group_facts.start_all_to_all(g, group, x, in_splits, out_splits)


class _AllToAll(torch.autograd.Function):
    """The all_to_all of rows; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any,
                library: bool) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.library = (in_splits, out_splits), group, library
        return _issue(x, in_splits, out_splits, group, library).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        in_splits, out_splits = ctx.splits
        return _issue(grad, out_splits, in_splits, ctx.group, ctx.library).wait(), None, None, None, None


class Pending:
    """An all_to_all in flight (its operation, until the wait) and its backward's, and the route both take."""

    __slots__ = ("grad_op", "library", "op")

    def __init__(self, library: bool) -> None:
        self.op = self.grad_op = None
        self.library = library


class _Start(torch.autograd.Function):
    """Issue the all_to_all (async) and return its receive buffer, not to be read before `_Wait`. Backward: wait
    for the gradient's all_to_all that `_Wait`'s backward issued and return what it received."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any,
                pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        pending.op = _issue(x, in_splits, out_splits, group, pending.library, async_op=True)
        return pending.op.out

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        p = ctx.pending
        grad, p.grad_op = p.grad_op.wait(), None
        return grad, None, None, None, None


class _Wait(torch.autograd.Function):
    """Wait for `_Start`'s all_to_all and return the rows received. Backward: issue the gradient's all_to_all
    (async, the splits swapped); autograd runs the nodes recorded between the start and the wait (later sequence
    numbers first) before `_Start`'s backward waits for it."""

    @staticmethod
    def forward(ctx: Any, buf: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any,
                pending: Pending) -> torch.Tensor:
        pending.op.wait()
        pending.op = None
        ctx.splits, ctx.group, ctx.pending = (in_splits, out_splits), group, pending
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        in_splits, out_splits = ctx.splits
        p = ctx.pending
        p.grad_op = _issue(grad, out_splits, in_splits, ctx.group, p.library, async_op=True)
        return grad, None, None, None, None  # a placeholder: _Start's backward returns what the all_to_all got


def start_all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any, *,
                     library: bool = False) -> tuple[torch.Tensor, Any]:
    """`dispatch_all_to_all` split in two: issue it and return (the receive buffer, the pending operation); run
    other work, then `wait_all_to_all(buf, pending)` for the rows. Differentiable: the backward's all_to_all is in
    flight while autograd runs the backward of the nodes recorded between this call and the wait. `library`: the
    library's all_to_all_single even where the ranks share memory."""
    pending = Pending(library)
    in_splits, out_splits = list(in_splits), list(out_splits)
    pending_call = (in_splits, out_splits, group, pending)
    return _Start.apply(x, *pending_call), pending_call


def wait_all_to_all(buf: torch.Tensor, pending: Any) -> torch.Tensor:
    """The rows of `start_all_to_all`'s operation, once received."""
    return _Wait.apply(buf, *pending)


def dispatch_all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any, *,
                        library: bool = False) -> torch.Tensor:
    """Rows of `x` to the ranks of `group`: the first in_splits[0] rows to rank 0, the next in_splits[1] to rank 1,
    ...; returns the rows received, out_splits[j] of them from rank j, in rank order. Differentiable. `library`: as
    `start_all_to_all`."""
    return _AllToAll.apply(x, list(in_splits), list(out_splits), group, library)


def exchange_counts(counts: torch.Tensor, group: Any, *, library: bool = False) -> torch.Tensor:
    """`counts` (ranks, k) int64, row j what this rank sends to rank j; returns (ranks, k), row j what rank j sends
    to this rank (one all_to_all of ranks x k integers). `library`: as `start_all_to_all`."""
    ones = [1] * counts.shape[0]
    return _issue(counts, ones, ones, group, library).wait()


def library_start_all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any
                             ) -> tuple[torch.Tensor, Any]:
    """`start_all_to_all` through the library's all_to_all_single wherever the ranks are (the layer's `start` for
    a Gloo-only or NCCL-only run: `layer.start, layer.exchange = library_start_all_to_all, library_exchange_counts`)."""
    return start_all_to_all(x, in_splits, out_splits, group, library=True)


def library_exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """`exchange_counts` through the library's all_to_all_single wherever the ranks are."""
    return exchange_counts(counts, group, library=True)


def no_start(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> tuple[torch.Tensor, Any]:
    """The floor's `start_all_to_all`: nothing in flight, the rows stay where they are."""
    return x, None


def no_wait(buf: torch.Tensor, pending: Any) -> torch.Tensor:
    """The floor's `wait_all_to_all`."""
    return buf


def no_exchange(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """The communication-free floor's count exchange: this rank's own counts."""
    return counts


__all__ = ["dispatch_all_to_all", "exchange_counts", "library_exchange_counts", "library_start_all_to_all",
           "no_exchange", "no_start", "no_wait",
           "start_all_to_all", "wait_all_to_all"]
