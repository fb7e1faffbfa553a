"""Gradient clipping by the global norm of the reduced gradient, as torch.nn.utils.clip_grad_norm_ after DDP: each
bucket's program pauses before the all-reduce of its squared-norm partial; the partials of all buckets are summed and
all-reduced once."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import OptimizerError
from ..workloads.optimizer_contract import MAX_NORM
from .buckets import Bucket


class Clipping:
    """DistributedOptimizer's clipping (a mixin of it)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients by their global norm, as FSDP's clip_grad_norm_: the norm of the reduced gradient over
        every bucket and rank (one scalar all-reduce), which is what torch.nn.utils.clip_grad_norm_ after DDP
        computes. Returns that norm (before clipping); the next step() applies the clipping. Call it between
        backward() and step(), on every rank."""
        if not (isinstance(max_norm, int | float) and max_norm > 0):
            raise OptimizerError(f"max_norm must be a positive number, got {max_norm!r}")
        if self._paused is not None:
            raise OptimizerError("clip_grad_norm_ was already called for this step; call step() next")
        if self.max_grad_norm is None:  # the programs that clip: rebuilt once, state carried over
            self.max_grad_norm = float(max_norm)
            for b in self._ensure_buckets():
                self._rebuild(b, b.masked)
        self.max_grad_norm = float(max_norm)
        self._paused = self._start(self._ensure_buckets())
        self._clip(self._paused)
        return self._norm_sq.sqrt().to(torch.float32)

    def _clip_scalar(self) -> dict[str, float]:
        return {MAX_NORM: float(self.max_grad_norm)} if self.max_grad_norm is not None else {}

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last clipped step (None before one); read from the device when asked."""
        return None if self._norm_sq is None else math.sqrt(float(self._norm_sq))


def clip(opt: Any, runs: list[tuple[Bucket, Any, Iterator]], size: int) -> None:
    """Clip by the global norm of the reduced gradient of the whole model, as torch.nn.utils.clip_grad_norm_ after
    DDP (and over DTensor parameters): each bucket's program stops before the all-reduce of its squared-norm partial
    (split and reorder put it there); the partials are summed per set of groups their parameters are split over
    (a bucket holds one set: bucket_policy), all-reduced once over the optimizer's group, then each sum of split
    parameters once over its groups (replicated ones count once); every bucket then gets the total."""
    sums: dict[tuple, list[torch.Tensor]] = {}  # in bucket order: the same on every rank of a group
    groups: dict[tuple, list[Any]] = {}
    names = []
    for b, exe, steps in runs:
        name = b.norm
        while True:
            index, reads = next(steps)
            if name in exe.stage_names(index):
                break
        sums.setdefault(b.shards, []).append(next(iter(reads.values())).double())
        groups[b.shards] = b.shard_groups
        names.append(name)
    if not sums:
        sums[()] = [torch.zeros((), dtype=torch.float64, device=opt._buckets[0].device if opt._buckets else None)]
    parts = torch.stack([torch.stack(ps).sum() for ps in sums.values()])
    if size > 1:
        dist.all_reduce(parts, group=opt.process_group)
    for j, key in enumerate(sums):
        for group in groups.get(key, []):
            dist.all_reduce(parts[j:j + 1], group=group)
    total = parts.sum()
    for (_, exe, _), name in zip(runs, names, strict=True):
        exe.provide(name, total.to(torch.float32))
    opt._norm_sq = total  # read on demand (last_grad_norm): no device sync in the step
