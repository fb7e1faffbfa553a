"""A rank's part of a tensor split along one dim (`Shard`), and what a DTensor or an Executable's kept-sliced
state is in this format: the Shards a checkpoint stores as parts and reshards on load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..ir.layout import share_bounds
from ..sharding import is_dtensor, places_like_dtensor


@dataclass
class Shard:
    """Part `index` of `count` of a tensor whose whole size along `dim` is `total` (tensor_split sizes, or in
    proportion to `shares`, one positive int per part)."""

    part: torch.Tensor
    dim: int
    total: int
    index: int
    count: int
    shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.shares is not None:
            self.shares = tuple(self.shares)
            if len(self.shares) != self.count or not all(isinstance(x, int) and x > 0 for x in self.shares):
                raise CheckpointError(f"a Shard of {self.count} parts needs {self.count} positive int shares, got "
                                      f"{self.shares}")
        start, stop = self.bounds(self.index)
        if self.part.ndim <= self.dim or self.part.shape[self.dim] != stop - start:
            raise CheckpointError(f"a Shard of part {self.index} of {self.count} along dim {self.dim} of size "
                                  f"{self.total} needs {stop - start} rows there, got shape {list(self.part.shape)}")

    def bounds(self, index: int) -> tuple[int, int]:
        """[start, stop) of part `index` along `dim`."""
        return share_bounds(self.total, self.shares if self.shares is not None else self.count, index)



def as_shard(value: Any) -> Any:
    """A DTensor as this format holds it: a Shard of this rank's part (sharded on one mesh dim; its part aliases the
    local tensor, so a load fills the DTensor in place), or its local tensor (replicated); anything else as it is."""
    if not is_dtensor(value):
        return value
    sharded = [(i, pl.dim) for i, pl in enumerate(value.placements) if pl.is_shard()]
    part = value._local_tensor
    if not sharded:
        return part
    if len(sharded) > 1 or any(pl.is_partial() for pl in value.placements):
        raise CheckpointError(f"a DTensor sharded on {len(sharded)} mesh dims ({list(value.placements)}) is not "
                              "supported by cocoweave.checkpoint; save it with torch.distributed.checkpoint")
    i, dim = sharded[0]
    mesh, size = value.device_mesh, value.shape[dim]
    count = mesh.size(i)
    if places_like_dtensor(size, count):  # DTensor's torch.chunk parts are the Shard's own tensor_split parts
        return Shard(part, dim, size, mesh.get_local_rank(i), count)
    sizes = [len(c) for c in torch.arange(size).chunk(count)]
    if len(sizes) != count:
        raise CheckpointError(f"a DTensor of {size} rows along dim {dim} split over {count} ranks leaves a rank "
                              "empty; cocoweave.checkpoint cannot place it")
    return Shard(part, dim, size, mesh.get_local_rank(i), count, tuple(sizes))


def executable_state(exe: Any) -> dict[str, Shard]:
    """This rank's kept-sliced state of a torch-backend Executable, as Shards (saved and loaded in place).

    State the executable has not been given yet is allocated (uninitialised), so that loading into a fresh
    executable on any world size restores it; its next `run` then continues from the loaded values."""
    from ..ir.layout import placements
    from ..ir.types import bind_shape

    out: dict[str, Shard] = {}
    for name in exe.plan.sliced_state:
        v = exe.program.inputs[name]
        if exe.rank not in v.group.ranks(exe.world_size):
            continue
        pos = v.position(exe.rank, exe.world_size)
        was = exe.plan.unsliced.get(name)
        if was is not None and not was.is_replicated:
            raise CheckpointError(f"state `{name}` is kept sliced along one mesh axis and was split along others "
                                  "before; executable_state saves state that was Replicated before it was sliced")
        axis, p = next((i, p) for i, p in enumerate(placements(v.layout, len(pos.coords))) if p.is_sliced)
        part = exe.state_part(name)
        total = bind_shape(v.shape, exe.sizes)[p.dim]
        out[name] = Shard(part, p.dim, total, pos.coords[axis], pos.shape[axis], p.shares)
    return out
