"""The Plan: the narrow waist between schedules and backends. Backends consume Plans, never Programs.

A plan is the schedule's stages (the stage kinds of schedule/stages.py, one class each) with their values
resolved to the scheduled program's Values and everything a consumer needs computed once by `lower`:
each stage's live-outs, chunked chains flattened into parts that each run on their own, the host scalars,
the state written in place and the outputs. A rank's place in it (group ranks, local shapes, which stages
it takes part in) is `plan.view(rank, world_size, sizes)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..ir.graph import Program, Value
from ..ir.layout import Layout
from ..schedule.stages import Stage
from .view import RankView


@dataclass
class Plan:
    """What every rank runs for one step of a scheduled program."""

    name: str
    program: Program
    stages: list[Stage]
    host: list[Value]  # scalar-only arithmetic, computed once on the host before the stages
    state: dict[str, Value]  # state input name -> value holding its new contents (written in place)
    sliced_state: list[str]  # inputs the schedule stores sliced (as_slice)
    outputs: list[tuple[str, Value]]
    fingerprint: str
    unsliced: dict[str, Layout] = field(default_factory=dict)  # sliced state -> its layout in the program as written

    def view(self, rank: int, world_size: int, sizes: Mapping[str, int]) -> RankView:
        """World rank `rank`'s view of this plan at `world_size` ranks with `sizes` bound."""
        self.program.check_world(world_size)
        return RankView(rank, world_size, dict(sizes))

    def live_outs(self) -> set[int]:
        """ids of the values read across a top-level stage boundary or kept as results (the parts of a chunked
        chain or fused collective list their own live-outs, which add what the other parts read)."""
        return {id(v) for s in self.stages for v in s.live_outs}

    def __str__(self) -> str:
        lines = [f"plan {self.name}  ({self.fingerprint})"]
        if self.host:
            lines.append("  host: " + ", ".join(v.name for v in self.host))
        for i, s in enumerate(self.stages):
            lines.append(f"  {i}: {s.label:<10} {', '.join(s.names)}")
        for n, v in self.state.items():
            lines.append(f"  state {n} <- {v.name}" + ("  (kept sliced)" if n in self.sliced_state else ""))
        for n, v in self.outputs:
            lines.append(f"  output {n} = {v.name}")
        return "\n".join(lines)
