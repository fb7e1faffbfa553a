"""One rank's view of a plan: where it sits in each process group, which stages it takes part in, and the
local shapes of values with sizes bound. Code generators and the cost model read these facts from here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..ir.graph import Value
from ..ir.layout import Position, local_shape, part_bounds
from ..ir.types import bind_shape
from ..schedule.stages import Stage


@dataclass(frozen=True)
class RankView:
    """World rank `rank` of `world_size`, with the program's sizes bound."""

    rank: int
    world_size: int
    sizes: Mapping[str, int]

    def in_group(self, v: Value) -> bool:
        """Whether this rank holds `v` (scalars and constants: every rank)."""
        return v.group is None or self.rank in v.group.ranks(self.world_size)

    def group_rank(self, v: Value) -> tuple[int, int]:
        """(index of this rank in v's group, size of the group)."""
        ranks = v.group.ranks(self.world_size)
        return ranks.index(self.rank), len(ranks)

    def position(self, v: Value) -> Position:
        """Where this rank sits in v's group: its mesh coordinates (its group rank without a mesh)."""
        return v.position(self.rank, self.world_size)

    def line(self, v: Value) -> tuple[int, int]:
        """(index of this rank, number of ranks) along the mesh axis that communication value v runs over."""
        line = v.args[0].group.line(self.rank, self.world_size, v.attrs.get("axis"))
        return line.index(self.rank), len(line)

    def local_shape(self, v: Value) -> tuple[int, ...]:
        """The shape of this rank's part of v."""
        return local_shape(v, self.sizes, self.position(v))

    def bounds(self, v: Value) -> list[tuple[int, int]]:
        """[start, stop) per dimension of this rank's part of v in the logical tensor."""
        return part_bounds(v.layout, bind_shape(v.shape, self.sizes), self.position(v))

    def takes_part(self, stage: Stage) -> bool:
        """A rank runs a stage if it holds any of its values or sends any of them."""
        return any(self.in_group(v) or (v.op == "send" and self.in_group(v.args[0])) for v in stage.values)
