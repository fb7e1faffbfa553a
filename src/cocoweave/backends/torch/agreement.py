"""Plan agreement: before an executable's first collective, every rank checks that all ranks run the same
plan on the same sizes, so ranks given different programs fail at once with a sentence instead of hanging."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ...errors import BackendError


def _short(value: str, limit: int = 64) -> str:
    return repr(value) if len(value) <= limit else repr(value[: limit - 3]) + "..."


def agree(value: str, what: str, group: dist.ProcessGroup | None = None,
          parts: Mapping[str, str] | None = None) -> str:
    """All-gather `value` and raise BackendError on every rank if the ranks disagree; returns `value`. With `parts`
    (what `value` is made of, by name: program, schedule, sizes...) the error also names the first part that differs.

    Call it before any other collective (e.g. on a program fingerprint): mismatched ranks fail at start."""
    if not dist.is_available() or not dist.is_initialized():
        return value
    size = dist.get_world_size(group)
    values: list[Any] = [None] * size
    dist.all_gather_object(values, str(value), group=group)
    j = next((j for j, other in enumerate(values) if other != values[0]), None)
    if j is None:
        return value
    r0 = 0 if group is None else dist.get_global_rank(group, 0)
    rj = j if group is None else dist.get_global_rank(group, j)
    text = f"ranks disagree on {what}: rank {r0} has {_short(values[0])}, rank {rj} has {_short(values[j])}"
    if parts is not None:  # every rank saw the same mismatch: all gather the parts too
        every: list[Any] = [None] * size
        dist.all_gather_object(every, dict(parts), group=group)
        first = next((k for k in every[0] if every[0].get(k) != every[j].get(k)), None)
        if first is not None:
            text += (f"; they differ first in the {first}: rank {r0} has {_short(str(every[0][first]))}, rank {rj} "
                     f"has {_short(str(every[j].get(first)))}")
    raise BackendError(text)
