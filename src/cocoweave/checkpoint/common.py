"""What save and load share: whether a group spans several ranks, this rank in it, rank 0's outcome on every
rank, and a failure in one line (saying first when the disk is full, however deep DCP wrapped it)."""

from __future__ import annotations

import errno
from typing import Any

import torch.distributed as dist


def _is_dist(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _rank(group: Any) -> int:
    return dist.get_rank(group) if _is_dist(group) else 0



def _describe(exc: BaseException, behind: BaseException | None = None) -> str:
    """One line for a failure, saying first that the disk is full when that is the cause anywhere behind it (or
    behind `behind`, e.g. every rank's failure of a DCP CheckpointException): DCP's writer threads wrap the OSError
    in their own exceptions, which alone do not say so."""
    text = str(exc).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    full = _no_space(behind if behind is not None else exc)
    return line if full is None or full in line else f"the disk is full ({full}); {line}"


_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


def _no_space(exc: BaseException) -> str | None:
    """The strerror of a no-space (or quota) OSError in `exc`'s causes, contexts or DCP failures, else None."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return _FULL[e.errno]
        text = str(e)
        for code, words in _FULL.items():
            if words in text or f"[Errno {code}]" in text:
                return words
        stack += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [w[0] if isinstance(w, tuple) and w else w for w in failures.values()
                      if isinstance(w[0] if isinstance(w, tuple) and w else w, BaseException)]
    return None


def _from_rank0(value: Any, group: Any) -> Any:
    """Rank 0's `value` on every rank of `group` (a barrier that carries rank 0's outcome)."""
    if not _is_dist(group):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]

