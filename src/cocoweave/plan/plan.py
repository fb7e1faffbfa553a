"""The Plan: an ordered list of stages over named buffers. Backends consume Plans, never Programs.

Stages reference the scheduled program's values (like torch.fx nodes): a backend evaluates a
value's operation on its operands' buffers. A rank runs the stages of the process groups it is in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..ir.graph import Group, Program, Value


@dataclass
class PlanStage:
    """Base class: a stage computes `values` (program values, in order) on one process group."""

    values: list[Value]

    @property
    def group(self) -> Group:
        return self.values[-1].group

    @property
    def label(self) -> str:
        return type(self).__name__

    def reads(self) -> list[Value]:
        """Values from outside the stage that it reads (its input buffers)."""
        inside = {id(v) for v in self.values}
        seen: dict[int, Value] = {}
        for v in self.values:
            for a in v.args:
                if id(a) not in inside and not a.is_scalar:
                    seen.setdefault(id(a), a)
        return list(seen.values())


@dataclass
class Kernel(PlanStage):
    """Computation: one generated kernel when `fused`, else one torch op per operation."""

    fused: bool = False

    @property
    def label(self) -> str:
        return "C" if self.fused else "c"


@dataclass
class MatMul(PlanStage):
    """One matrix multiplication."""

    @property
    def label(self) -> str:
        return "MM"


@dataclass
class Collective(PlanStage):
    """One collective over the value's process group; `algorithm` is "library" (torch.distributed)
    or "ring" (point-to-point ring, chunk by chunk)."""

    algorithm: str = "library"

    @property
    def label(self) -> str:
        token = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC",
                 "reduce": "R"}[self.values[0].op]
        return token + ("" if self.algorithm == "library" else f"@{self.algorithm}")


@dataclass
class P2P(PlanStage):
    """Send to the next process group: group rank i sends to group rank i."""

    @property
    def group(self) -> Group:
        return self.values[0].args[0].group

    @property
    def label(self) -> str:
        return "P2P"


@dataclass
class FusedCollective(PlanStage):
    """ReduceScatter + computation + AllGather as one stage. With algorithm "ring", the computation
    is applied to each chunk of the reduce-scatter as soon as it is fully reduced (CoCoNet's fused ring)."""

    reduce_scatter: Value | None = None
    kernel: Kernel | None = None
    all_gathers: list[Value] = field(default_factory=list)
    algorithm: str = "library"

    @property
    def label(self) -> str:
        return "fuse(RS-C-AG)" + ("" if self.algorithm == "library" else f"@{self.algorithm}")


@dataclass
class Chunked(PlanStage):
    """A producer/consumer chain run in `chunks` chunks along dimension `dim` of its values, so that
    chunk i's communication overlaps chunk i+1's computation."""

    stages: list[PlanStage] = field(default_factory=list)
    chunks: int = 2
    dim: int = 0

    @property
    def label(self) -> str:
        return f"ol({','.join(s.label for s in self.stages)},{self.chunks})"


@dataclass
class Plan:
    """What every rank runs for one step of a scheduled program."""

    name: str
    program: Program
    stages: list[PlanStage]
    host: list[Value]  # scalar-only arithmetic, computed once on the host before the stages
    state: dict[str, Value]  # state input name -> value holding its new contents (written in place)
    sliced_state: list[str]  # inputs the schedule stores sliced (as_slice)
    outputs: list[tuple[str, Value]]
    fingerprint: str

    def stages_for(self, rank: int, world_size: int) -> list[PlanStage]:
        """The stages world rank `rank` takes part in (a P2P stage involves both groups)."""
        mine = []
        for s in self.stages:
            groups = {s.group} | ({s.values[0].group} if isinstance(s, P2P) else set())
            if any(rank in g.ranks(world_size) for g in groups):
                mine.append(s)
        return mine

    def walk(self) -> Iterator[PlanStage]:
        """Every stage, nested ones included, in order."""
        for s in self.stages:
            yield s
            if isinstance(s, Chunked):
                yield from s.stages
            if isinstance(s, FusedCollective) and s.kernel is not None:
                yield s.kernel

    def __str__(self) -> str:
        lines = [f"plan {self.name}  ({self.fingerprint})"]
        if self.host:
            lines.append("  host: " + ", ".join(v.name for v in self.host))
        for i, s in enumerate(self.stages):
            lines.append(f"  {i}: {s.label:<10} {', '.join(v.name for v in s.values)}")
        for n, v in self.state.items():
            lines.append(f"  state {n} <- {v.name}" + ("  (kept sliced)" if n in self.sliced_state else ""))
        for n, v in self.outputs:
            lines.append(f"  output {n} = {v.name}")
        return "\n".join(lines)
