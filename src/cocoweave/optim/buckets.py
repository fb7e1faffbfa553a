"""Buckets: parameters and gradients as views into contiguous buffers, as Megatron-core's param-and-grad buffer and
DDP's gradient_as_bucket_view keep them, so that a bucket's program reads and writes them without copies.

A bucket holds parameters of one parameter group, dtype and device (LAMB: and one size, one row each; a shaped bucket:
and one shape, one row each, kept in that shape), in the
order backward produces their gradients (the reverse of registration, as DDP assumes), up to a size cap. After
`attach`, every parameter's `.data` is a view into `data` and its `.grad` a view into `grad`: backward
accumulates straight into the bucket, and the program's all-gather writes the new weights straight into the
parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sharding import is_dtensor, local_data
from .bucket_policy import BucketPolicy, flat_size
from .bucket_program import BucketProgram
from .placements import local, local_grad, set_data, set_grad, shard_groups, shard_key


@dataclass
class Bucket:
    """Parameters of one group (and dtype, device; for row buckets one size) run by one program instance."""

    group: int
    params: list[torch.nn.Parameter]
    rows: bool = False  # LAMB: parameter i is row i of a [T, N] buffer
    pad_to: int = 1  # a flat bucket's size is a multiple of this (the world size), its tail zeros
    shaped: bool = False  # rows in the parameters' shape S: parameter i is [i] of a [T, *S] buffer (implies rows)
    offsets: list[int] = field(default_factory=list)
    data: torch.Tensor | None = None  # the parameters, flat ([N], or [T, N] for rows, [T, *S] shaped)
    grad: torch.Tensor | None = None  # their gradients, the same shape
    schedule: Any = None
    exe: BucketProgram | None = None  # the compiled program (cocoweave Executable), through its one interface
    masked: bool = False  # it runs the masked program: a parameter of the bucket once went without a gradient
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # state given on every call (not kept sliced)
    step: int = 0  # steps taken while every parameter of the bucket had a gradient
    arrived: list = field(default_factory=list)  # parameter i: backward reached it since the last launch or step
    count: int = 0  # how many have arrived (a list and a count, not a set: the hooks run per parameter per step)
    zeroed: list = field(default_factory=list)  # parameter i's gradient view is known to hold zeros
    launched: bool = False  # the gradient reduction was issued from a backward hook
    version: int | None = None  # the gradients' version counter when backward last wrote them
    norm: str | None = None  # clipping: the scalar all-reduce of the program's squared-norm partials
    in_slot: bool = False  # `grad` is the slot of a shared-memory reduction, which leaves this rank's part reduced
    stale: list = field(default_factory=list)  # parameter i's gradient view still holds the last reduction
    plain: list = field(default_factory=list)  # parameter i is a plain tensor (not a DTensor)
    started: bool = False  # SGD: the momentum buffer exists (torch's state has a momentum_buffer)
    grads: list = field(default_factory=list)  # parameter i's view of `grad` (made once per buffer: host time)
    weights: list = field(default_factory=list)  # parameter i's view of `data`
    weight_ptrs: list = field(default_factory=list)  # their data pointers
    step_count: torch.Tensor | None = None  # `step`, the 0-d tensor every parameter's opt.state[p]["step"] is
    shards: tuple = ()  # the global ranks of each group its (DTensor) parameters are split over (placements.py)
    shard_groups: list = field(default_factory=list)  # those groups of more than one rank: clipping sums over them

    def __post_init__(self) -> None:
        self.rows = self.rows or self.shaped
        sizes = [local(p).numel() for p in self.params]
        self.offsets = [0] * len(sizes) if self.rows else [sum(sizes[:i]) for i in range(len(sizes))]
        self.shards = shard_key(self.params[0])
        self.shard_groups = [g for g, ranks in zip(shard_groups(self.params[0]), self.shards, strict=True)
                             if len(ranks) > 1]
        n = len(self.params)
        self.arrived, self.zeroed, self.stale = [False] * n, [False] * n, [False] * n

    def reset_arrivals(self) -> None:
        """No parameter has arrived (after a launch, a step or zero_grad)."""
        self.arrived = [False] * len(self.params)
        self.count = 0

    @property
    def shape(self) -> tuple[int, ...]:
        if self.shaped:
            return (len(self.params), *local(self.params[0]).shape)
        if self.rows:
            return (len(self.params), local(self.params[0]).numel())
        return (flat_size(sum(local(p).numel() for p in self.params), self.pad_to),)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def part(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's elements of a bucket-shaped buffer, in the parameter's shape (a view)."""
        p = local(self.params[i])
        flat = buf[i] if self.rows else buf[self.offsets[i]:self.offsets[i] + p.numel()]
        return flat.view(p.shape)

    def fill(self, buf: torch.Tensor, parts: list[torch.Tensor | float | None]) -> torch.Tensor:
        """Write parameter i's part of bucket-shaped `buf` from parts[i] (a tensor of the parameter's elements, a
        number for all of them, or None: left as it is); returns `buf`."""
        for i, v in enumerate(parts):
            if isinstance(v, torch.Tensor):
                self.part(buf, i).copy_(local(v).reshape(local(self.params[i]).shape))
            elif v is not None:
                self.part(buf, i).fill_(v)
        return buf

    def attach(self, grad: torch.Tensor | None = None, data: torch.Tensor | None = None,
               keep_grad: bool = False) -> None:
        """Move the parameters into one buffer (`data`, or a new one) and their gradients into `grad` (a new buffer
        when None); e.g. the shared-memory slots of the program's collectives. A parameter's `.grad` becomes its view
        of `grad` when it has one (a gradient computed before the optimizer was made is copied in) and stays None
        otherwise, as torch keeps it. With `keep_grad` the gradient views keep their values (a bucket moving to a
        recompiled program's slots mid-step)."""
        data = data if data is not None else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.part(data, i).copy_(local_data(p))
            if not self.rows:  # the padding: zeros, which every update leaves zero
                data[sum(local(p).numel() for p in self.params):].zero_()
        old = self.grad if keep_grad else None
        views = [old is not None and p.grad is not None and local(p.grad).data_ptr() == self.part(old, i).data_ptr()
                 for i, p in enumerate(self.params)]
        self.data = data
        self.grad = grad if grad is not None else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.grads = [self.part(self.grad, i) for i in range(len(self.params))]
        self.weights = [self.part(data, i) for i in range(len(self.params))]
        self.plain = [not is_dtensor(p) for p in self.params]  # a plain parameter's `.grad` is its view itself
        self.weight_ptrs = [w.data_ptr() for w in self.weights]  # what restore_views compares (once per buffer)
        if old is None:
            self.grad.zero_()
            self.zeroed = [True] * len(self.params)
        elif old.data_ptr() != self.grad.data_ptr():
            self.grad.copy_(old)
            if self.version is not None:  # still the gradients backward wrote: the check goes on from the copy
                self.version = self.grad._version
        for i, p in enumerate(self.params):
            set_data(p, self.weights[i])
            if views[i]:
                set_grad(p, self.grads[i])
            elif old is None and p.grad is not None:
                self.take(i)

    def take(self, i: int) -> None:
        """Parameter i's `.grad`, another tensor than its view (set by hand, or made by autograd outside the bucket),
        copied into the view (a sparse one densified), which becomes its `.grad`."""
        p, view, g = self.params[i], self.grads[i], local_grad(self.params[i])
        g = g.to_dense() if g.layout != torch.strided else g
        with torch.no_grad():
            view.copy_(g)
        set_grad(p, view)
        self.zeroed[i] = self.stale[i] = False

    def restore_views(self, copy: bool = True) -> list[int]:
        """Before a step: a parameter whose `.grad` is another tensor than its view (set by hand, or replaced) has it
        copied into the view; one whose `.grad` is None keeps None (torch skips it) and its view is zeroed. Returns
        the indices of the parameters without a gradient. (`copy=False`: the values are about to be zeroed.)"""
        missing = []
        for i, p in enumerate(self.params):
            view, g = self.grads[i], p.grad
            if g is view:  # the common case, checked without a call: the plain parameter's own view
                pass
            elif (g := None if g is None else local(g)) is None:
                missing.append(i)
                if not self.zeroed[i]:
                    view.zero_()
                    self.zeroed[i] = True
                self.stale[i] = False
            elif g.layout != view.layout or g.data_ptr() != view.data_ptr() or g.shape != view.shape:
                if copy:
                    self.take(i)
                else:
                    set_grad(p, view)
            if (p.data_ptr() if self.plain[i] else local_data(p).data_ptr()) != self.weight_ptrs[i]:
                self.weights[i].copy_(local_data(p))  # the user replaced the weights
                set_data(p, self.weights[i])
        return missing


def make_buckets(group_index: int, params: Iterable[torch.nn.Parameter], cap_bytes: int,
                 rows: bool = False, pad_to: int = 1) -> list[Bucket]:
    """Buckets of one parameter group, as BucketPolicy(cap_bytes, rows, pad_to) partitions them."""
    return buckets_of(BucketPolicy(cap_bytes, rows, pad_to), group_index, params)


def buckets_of(policy: BucketPolicy, group_index: int, params: Iterable[torch.nn.Parameter]) -> list[Bucket]:
    """Buckets of one parameter group: its parameters that need gradients as `policy` partitions them."""
    return [Bucket(group_index, ps, policy.rows, policy.pad_to, shaped=policy.shaped)
            for ps in policy.partition(params)]
