"""A process group's facts, in one home for nn/ and optim/: this rank's place in it (`world`, `group_rank`,
`group_size`), whether its collectives of a device's tensors go through this host's shared memory
(`shared_memory`: the one answer, for every layer and optimizer), its timeout (`group_timeout`), the
cross-rank check of a configuration (`agree`), and the collectives layers and optimizers run outside their programs
every step: the flag all-reduce (`max_flags`), the posted all-reduce (`PostedAllReduce`) and an MoE layer's
all-to-alls with runtime splits through shared memory (`start_all_to_all`).

It sits beside compiler.py, above backends/: nn/ and optim/ import no module of backends/ (tests/test_architecture.py)
and reach the torch backend only here and through the compiled executables, so a transport changes here and in
its backend, never in a layer or an optimizer. Backends never import it (the flow stays one-directional)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .backends.torch import shm
from .backends.torch import shm_all_to_all as shm_a2a
from .backends.torch.agreement import agree
from .backends.torch.placement import cpu_group
from .backends.torch.shm import Posted
from .schedule.enumerate import shm_offered

__all__ = ["Posted", "PostedAllReduce", "agree", "group_rank", "group_size", "group_timeout", "max_flags",
           "shared_memory", "start_all_to_all", "world"]


def world(group: Any = None) -> tuple[int, int]:
    """(rank, size) in `group` (the default process group when None); (0, 1) when torch.distributed is not
    initialised."""
    return group_rank(group), group_size(group)


def group_size(group: Any) -> int:
    """Ranks in `group` (the world if None); 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank within `group` (0 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def shared_memory(group: Any, device: torch.device | str) -> shm.ShmGroup | None:
    """The shared-memory group through which `group`'s collectives of tensors on `device` go, or None for the
    library's: only where the group has several ranks, every one on this host, and the tensors are in the host's
    memory (the collectives table says where its shm algorithm is offered). The one home of that decision for the
    layers' programs, their posted all-reduces, the MoE all-to-alls and the optimizer's buckets; the same answer on
    every rank (a collective of the group the first time it is asked)."""
    if group_size(group) < 2 or not shm_offered(str(device)):
        return None
    return shm.group_for(group)


def group_timeout(group: Any = None) -> float:
    """The timeout of `group` (None: the default group) in seconds: how long any wait on its ranks may last."""
    return shm.group_timeout(group)


def max_flags(group: Any, flags: torch.Tensor, slots: list[torch.Tensor] | None
              ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The maximum over `group`'s ranks of each of the int32 `flags` (a CPU tensor), and the shared-memory slots to
    pass to the next call: through shared memory on one host (`slots` made on the first call, or when the count
    changed), else one small all-reduce on the group's CPU side (a Gloo group beside a group that takes no CPU
    tensor), so that reading the result back syncs no GPU."""
    g = shm.group_for(group)
    if g is None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(group))
        return flags, slots
    n = flags.numel()
    if slots is None or slots[0].numel() != n:
        slots = g.slots("optim-flags", n, torch.int32)
    out = torch.empty_like(flags)
    shm.all_reduce(g, slots, flags, "max", [(0, n) if j == 0 else (n, 0) for j in range(g.size)], out)
    return out, slots


class PostedAllReduce:
    """One layer's posted all-reduces (sum) over its group on shared memory: this rank computes into its slot, marks
    it (`Posted.arrive`), works on, and sums the slots only when it needs the result (`Posted.finish`). The slots
    are made once per dtype and size and kept."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._buffers = shm.ShmBuffers()

    def open(self, out: torch.Tensor) -> Posted | None:
        """An all-reduce (sum) into `out`, or None where the group's ranks do not share this host's memory or its
        slots cannot be made or cannot alternate (the same on every rank): the caller then takes a blocking route."""
        g = shared_memory(self.group, out.device)
        if g is None:
            return None
        try:
            slots = self._buffers.get(g, ("async", out.dtype), out.numel(), out.dtype)
        except shm.ShmUnavailable:
            return None
        return shm.open_all_reduce(g, slots, out.numel(), "sum", out)

    def held_bytes(self) -> int:
        """Bytes of the shared-memory slots (and the sets they alternate with) these all-reduces keep: what
        pre-flight's memory model predicts for them."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for slots in self._buffers.slots.values() for t in (*slots, *(slots.spare or ()))}
        return sum(storages.values())


def start_all_to_all(route: Any, group: Any, x: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> Any:
    """Begin an all_to_all of `x`'s rows through shared-memory `route` (shared_memory's answer for `group`):
    in_splits[j] rows to group rank j, out_splits[j] from it; `.wait()` returns them (an MoE layer's dispatch and
    combine, whose splits the router decides each step)."""
    return shm_a2a.start(route, group, x, in_splits, out_splits)
