"""Plan agreement: before an executable's first collective, every rank checks that all ranks run the same
plan on the same sizes, so ranks given different programs fail at once with a sentence instead of hanging."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ...errors import BackendError


def _short(value: str, limit: int = 64) -> str:
    return repr(value) if len(value) <= limit else repr(value[: limit - 3]) + "..."


def agree(value: str, what: str, group: dist.ProcessGroup | None = None) -> str:
    """All-gather `value` and raise BackendError on every rank if the ranks disagree; returns `value`.

    Call it before any other collective (e.g. on a program fingerprint): mismatched ranks fail at start."""
    if not dist.is_available() or not dist.is_initialized():
        return value
    size = dist.get_world_size(group)
    values: list[Any] = [None] * size
    dist.all_gather_object(values, str(value), group=group)
    for j, other in enumerate(values):
        if other != values[0]:
            r0 = 0 if group is None else dist.get_global_rank(group, 0)
            rj = j if group is None else dist.get_global_rank(group, j)
            raise BackendError(f"ranks disagree on {what}: rank {r0} has {_short(values[0])}, "
                               f"rank {rj} has {_short(other)}")
    return value
