"""Parameters without a gradient, skipped as torch skips them: per bucket, which elements to update this step (the
ranks agree, as DDP's find_unused_parameters does), and sparse gradients refused where torch refuses them."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OptimizerError
from ..group_facts import max_flags
from .buckets import Bucket
from .placements import local


class Masks:
    """DistributedOptimizer's masks (a mixin of it)."""

    def _active(self, buckets: list[Bucket]) -> list[torch.Tensor | None]:
        """Per bucket, which elements to update (None: all of them). A parameter has a gradient if backward reached
        it since the last zero_grad(set_to_none=True), on some rank (the ranks agree, as DDP's reduction makes them),
        or the user gave it one; torch skips the others."""
        flags = []
        for b in buckets:
            self._check_grads(b)
            none = set(b.restore_views())
            if any(b.stale):
                raise OptimizerError(
                    f"{type(self).__name__}: step() was called without zero_grad() since the last step; the gradient "
                    "buffers were reduced in place (on one host the reduction works inside them), so gradients cannot "
                    "accumulate across steps. Call opt.zero_grad() (or model.zero_grad()) after each step, and "
                    "accumulate micro-batches with opt.no_sync() before one step instead")
            flags.append([0 if i in none else 1 for i in range(len(b.params))])
        have = self._agree([f for fs in flags for f in fs])
        out, k = [], 0
        for b, fs in zip(buckets, flags, strict=True):
            mine, k = have[k:k + len(fs)], k + len(fs)
            if all(mine) and not b.masked:
                out.append(None)
                continue
            mask = torch.zeros(b.shape, dtype=torch.bool, device=b.device)
            for i, h in enumerate(mine):
                if h:
                    b.part(mask, i).fill_(True)
            out.append(mask)
        return out

    def _check_grads(self, b: Bucket) -> None:
        """A sparse `.grad` set by hand where torch's optimizer refuses one, refused with torch's sentence."""
        if self.sparse_grads:
            return
        for p, view in zip(b.params, b.grads, strict=True):
            g = p.grad
            if g is not None and g is not view and local(g).layout != torch.strided:
                raise OptimizerError(f"{type(self).__name__} does not support sparse gradients (a parameter of shape "
                                     f"{list(p.shape)} has a {p.grad.layout} one), as torch's "
                                     f"{type(self).__name__.removeprefix('Distributed')} does not; use a dense "
                                     "gradient, or DistributedSGD")


def agree(opt: Any, flags: list[int], size: int) -> list[int]:
    """The maximum over the ranks of each flag, as DDP's find_unused_parameters all-reduces its used-parameter
    map: through shared memory on one host, else one small all-reduce. `opt`: the optimizer (its group, its
    buckets, its flag slots); `size`: its group's size."""
    if size == 1 or not flags:
        return flags
    out, opt._flag_slots = max_flags(opt.process_group, torch.tensor(flags, dtype=torch.int32), opt._flag_slots)
    return out.tolist()
