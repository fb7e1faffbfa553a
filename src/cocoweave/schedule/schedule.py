"""A Schedule: a program plus the ordered transformation steps applied to it.

Graph rewrites (split, reorder, as_slice) change the program; fuse, overlap and algorithm choices then
group and configure its stages. Each method builds a typed step (steps.py), applies it and records it;
every step checks its preconditions (ScheduleError with a sentence otherwise) and keeps the program's
results. A schedule prints, saves to JSON, is rebuilt from its steps (`Schedule(program, steps)`), and
has a fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ScheduleError
from ..ir.graph import Program, Value
from . import stages as st
from .stages import Stage
from .steps import Algorithm, AsSlice, Fuse, Overlap, Reorder, Split, Step

Ref = str | Value | Stage


def _name(ref: Ref) -> str:
    if isinstance(ref, Stage):
        return ref.anchor
    return ref.name if isinstance(ref, Value) else ref


class Schedule:
    """A program and the checked steps applied to it; `program` is the rewritten program.

    `Schedule(program, steps)` applies recorded steps (Step objects or their JSON dicts), in order."""

    def __init__(self, program: Program, steps: Iterable[Step | Mapping[str, Any]] = ()):
        self.original = program
        self.program = program
        self.steps: list[Step] = []
        self._stages: list[Stage] = st.base_stages(program)
        self._apply(*[s if isinstance(s, Step) else Step.from_json(s) for s in steps])

    def _apply(self, *steps: Step) -> Any:
        """Apply and record `steps` in order, all or nothing; returns what the last one returns."""
        saved = self.program, self._stages, len(self.steps)
        result = None
        try:
            for step in steps:
                result = self.advance(step)
                self.steps.append(step)
        except BaseException:  # a refused step leaves the schedule as it was
            self.program, self._stages = saved[:2]
            del self.steps[saved[2]:]
            raise
        return result

    def advance(self, step: Step) -> Any:
        """Apply `step` without recording it (Step.apply): the program and stages become what the step maps them to
        (steps are pure maps of them); returns what the step's Schedule method returns. The methods below record."""
        self.program, self._stages = step.map(self.program, self.stages, self.steps)
        return step.result(self)

    # -- graph rewrites -----------------------------------------------------------------------
    def split(self, all_reduce: Ref, dim: int = 0, shares: tuple[int, ...] | None = None) -> tuple[Stage, Stage]:
        """AllReduce -> ReduceScatter + AllGather (over the all_reduce's mesh axis), the scattered parts in
        proportion to `shares` (one positive int per rank along the axis) when given. Returns the two new stages."""
        return self._apply(Split(_name(all_reduce), dim, tuple(shares) if shares is not None else None))

    def reorder(self, all_gather: Ref) -> list[Stage]:
        """Move the computation after an AllGather onto slices, before it. Returns the stages
        from the first moved computation on."""
        return self._apply(Reorder(_name(all_gather)))

    def as_slice(self, *names: str) -> None:
        """Store these state tensors sliced (1/p memory); their whole-tensor AllGathers disappear.
        All or nothing: a refused name leaves the schedule unchanged."""
        self._apply(*[AsSlice(n) for n in names])

    # -- stage grouping -----------------------------------------------------------------------
    def fuse(self, *stages: Ref) -> Stage:
        """Consecutive stages become one: one kernel for computations, one fused collective stage
        for ReduceScatter + computation + AllGather."""
        return self._apply(Fuse(tuple(_name(s) for s in stages)))

    def overlap(self, *stages: Ref, chunks: int = 4) -> Stage:
        """Run a producer/consumer chain of stages in `chunks` chunks, overlapping communication of
        one chunk with computation of the next."""
        return self._apply(Overlap(tuple(_name(s) for s in stages), chunks))

    def algorithm(self, stage: Ref, name: str) -> Stage:
        """Run a collective (AR, RS, AG) or fused RS-C-AG stage on collective algorithm `name`:
        "library" (torch.distributed's call) or "ring" (point-to-point ring; a fused stage computes
        each piece as soon as it is reduced). Results do not change, only how they travel."""
        return self._apply(Algorithm(_name(stage), name))

    # -- queries ------------------------------------------------------------------------------
    @property
    def stages(self) -> list[Stage]:
        return list(self._stages)

    def stage(self, ref: Ref) -> Stage:
        """The stage that computes `ref` (a value name, a Value or a Stage)."""
        return self._stages[st.locate(self._stages, _name(ref))]

    def find(self, op: str) -> list[Stage]:
        """Stages whose first value is operation `op` ("all_reduce", "matmul", ...)."""
        return [s for s in self._stages if st.value(self.program, s.anchor).op == op]

    @property
    def sliced_state(self) -> list[str]:
        """Inputs stored sliced by as_slice."""
        return [s.name for s in self.steps if isinstance(s, AsSlice)]

    @property
    def name(self) -> str:
        """Readable name, e.g. AR-C, RS-C-AG+slice(m,v), ol(MM,fuse(RS-C-AG),4)."""
        label = st.join_labels(self._stages)
        return label + (f"+slice({','.join(self.sliced_state)})" if self.sliced_state else "")

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        lines = [f"schedule {self.name}  ({self.fingerprint()})"]
        lines += [f"  step {s}" for s in self.steps] or ["  (no steps: the program as written)"]
        lines += [f"  stage {i}: {s.label} [{', '.join(s.values)}]" for i, s in enumerate(self._stages)]
        return "\n".join(lines) + "\n" + str(self.program)

    # -- persistence --------------------------------------------------------------------------
    def steps_json(self) -> list[dict[str, Any]]:
        """The steps as JSON dicts: the saved form (schedules, tune caches) that `Schedule(program, steps)` reads."""
        return [s.to_json() for s in self.steps]

    def to_json(self) -> str:
        return json.dumps({"program": self.original.name, "program_fingerprint": self.original.fingerprint(),
                           "name": self.name, "steps": self.steps_json()}, indent=2)

    @classmethod
    def from_json(cls, text: str, program: Program) -> Schedule:
        """Rebuild a saved schedule on `program` (which must have the same fingerprint)."""
        data = json.loads(text)
        if data.get("program_fingerprint") != program.fingerprint():
            raise ScheduleError(f"the schedule was made for program `{data.get('program')}` with fingerprint "
                                f"{data.get('program_fingerprint')}, not `{program.name}` ({program.fingerprint()})")
        return cls(program, data["steps"])

    def fingerprint(self) -> str:
        """16 hex digits identifying the program and the steps applied to it."""
        text = self.original.fingerprint() + json.dumps(self.steps_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

