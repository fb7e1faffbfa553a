"""A Schedule: a program plus the ordered transformation steps applied to it.

Graph rewrites (split, reorder, as_slice) change the program; fuse and overlap then group its
stages. Every step checks its preconditions (ScheduleError with a sentence otherwise) and keeps
the program's results. A schedule prints, saves to JSON, replays onto a fresh program, and has a
fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import ScheduleError
from ..ir.graph import Program, Value
from . import stages as st
from .as_slice import as_slice
from .reorder import reorder
from .split import split
from .stages import Stage

Ref = str | Value | Stage


def _name(ref: Ref) -> str:
    if isinstance(ref, Stage):
        return ref.anchor
    return ref.name if isinstance(ref, Value) else ref


class Schedule:
    """A program and the checked steps applied to it; `program` is the rewritten program."""

    def __init__(self, program: Program):
        self.original = program
        self.program = program
        self.steps: list[dict[str, Any]] = []
        self._stages: list[Stage] = st.base_stages(program)

    # -- graph rewrites -----------------------------------------------------------------------
    def _rewrite(self, step: dict[str, Any], program: Program) -> None:
        self.steps.append(step)
        self._rewrite_program(program)

    def _rewrite_program(self, program: Program) -> None:
        self.program = program
        self._stages = st.base_stages(program)

    def _before_grouping(self, verb: str) -> None:
        if any(s["step"] in ("fuse", "overlap", "algorithm") for s in self.steps):
            raise ScheduleError(f"{verb} must come before fuse and overlap and algorithm choices: it changes the "
                                "stages they group")

    def split(self, all_reduce: Ref, dim: int = 0) -> tuple[Stage, Stage]:
        """AllReduce -> ReduceScatter + AllGather. Returns the two new stages."""
        self._before_grouping("split")
        program, rs, ag = split(self.program, _name(all_reduce), dim)
        self._rewrite({"step": "split", "ref": _name(all_reduce), "dim": dim}, program)
        return self.stage(rs), self.stage(ag)

    def reorder(self, all_gather: Ref) -> list[Stage]:
        """Move the computation after an AllGather onto slices, before it. Returns the stages
        from the first moved computation on."""
        self._before_grouping("reorder")
        ag = _name(all_gather)
        program = reorder(self.program, ag)
        self._rewrite({"step": "reorder", "ref": ag}, program)
        rs = ag[:-3] + ".rs" if ag.endswith(".ag") else None
        start = st.locate(self._stages, rs) + 1 if rs and any(rs in s.values for s in self._stages) else 0
        return self._stages[start:]

    def as_slice(self, *names: str) -> None:
        """Store these state tensors sliced (1/p memory); their whole-tensor AllGathers disappear."""
        self._before_grouping("as_slice")
        program = self.program
        for n in names:  # all or nothing: a refused name leaves the schedule unchanged
            program = as_slice(program, n)
        for n in names:
            self.steps.append({"step": "as_slice", "name": n})
        self._rewrite_program(program)

    # -- stage grouping -----------------------------------------------------------------------
    def fuse(self, *stages: Ref) -> Stage:
        """Consecutive stages become one: one kernel for computations, one fused collective stage
        for ReduceScatter + computation + AllGather."""
        refs = tuple(_name(s) for s in stages)
        self._stages = st.fuse(self.program, self._stages, refs)
        self.steps.append({"step": "fuse", "refs": list(refs)})
        return self.stage(refs[0])

    def overlap(self, *stages: Ref, chunks: int = 4) -> Stage:
        """Run a producer/consumer chain of stages in `chunks` chunks, overlapping communication of
        one chunk with computation of the next."""
        refs = tuple(_name(s) for s in stages)
        self._stages = st.overlap(self.program, self._stages, refs, chunks)
        self.steps.append({"step": "overlap", "refs": list(refs), "chunks": chunks})
        return self.stage(refs[0])

    def algorithm(self, stage: Ref, name: str) -> Stage:
        """Run a collective (AR, RS, AG) or fused RS-C-AG stage on collective algorithm `name`:
        "library" (torch.distributed's call) or "ring" (point-to-point ring; a fused stage computes
        each piece as soon as it is reduced). Results do not change, only how they travel."""
        ref = _name(stage)
        self._stages = st.set_algorithm(self.program, self._stages, ref, name)
        self.steps.append({"step": "algorithm", "ref": ref, "algorithm": name})
        return self.stage(ref)

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
        return [s["name"] for s in self.steps if s["step"] == "as_slice"]

    @property
    def name(self) -> str:
        """Readable name, e.g. AR-C, RS-C-AG+slice(m,v), ol(MM,fuse(RS-C-AG),4)."""
        label = st.join_labels(self._stages)
        return label + (f"+slice({','.join(self.sliced_state)})" if self.sliced_state else "")

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        lines = [f"schedule {self.name}  ({self.fingerprint()})"]
        lines += ["  step " + _format_step(s) for s in self.steps] or ["  (no steps: the program as written)"]
        lines += [f"  stage {i}: {s.label} [{', '.join(s.values)}]" for i, s in enumerate(self._stages)]
        return "\n".join(lines) + "\n" + str(self.program)

    # -- persistence --------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"program": self.original.name, "program_fingerprint": self.original.fingerprint(),
                           "name": self.name, "steps": self.steps}, indent=2)

    @classmethod
    def from_json(cls, text: str, program: Program) -> Schedule:
        """Replay a saved schedule onto `program` (which must have the same fingerprint)."""
        data = json.loads(text)
        if data.get("program_fingerprint") != program.fingerprint():
            raise ScheduleError(f"the schedule was made for program `{data.get('program')}` with fingerprint "
                                f"{data.get('program_fingerprint')}, not `{program.name}` ({program.fingerprint()})")
        return cls.replay(program, data["steps"])

    @classmethod
    def replay(cls, program: Program, steps: list[dict[str, Any]]) -> Schedule:
        """Apply recorded steps, in order, to a fresh schedule of `program`."""
        s = cls(program)
        for step in steps:
            kind = step.get("step")
            if kind == "split":
                s.split(step["ref"], step.get("dim", 0))
            elif kind == "reorder":
                s.reorder(step["ref"])
            elif kind == "as_slice":
                s.as_slice(step["name"])
            elif kind == "fuse":
                s.fuse(*step["refs"])
            elif kind == "overlap":
                s.overlap(*step["refs"], chunks=step["chunks"])
            elif kind == "algorithm":
                s.algorithm(step["ref"], step["algorithm"])
            else:
                raise ScheduleError(f"unknown schedule step {kind!r}")
        return s

    def fingerprint(self) -> str:
        """16 hex digits identifying the program and the steps applied to it."""
        text = self.original.fingerprint() + json.dumps(self.steps, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _format_step(s: dict[str, Any]) -> str:
    if s["step"] == "split":
        return f"split({s['ref']}, dim={s['dim']})"
    if s["step"] == "reorder":
        return f"reorder({s['ref']})"
    if s["step"] == "as_slice":
        return f"as_slice({s['name']})"
    if s["step"] == "fuse":
        return f"fuse({', '.join(s['refs'])})"
    if s["step"] == "algorithm":
        return f"algorithm({s['ref']}, {s['algorithm']!r})"
    return f"overlap({', '.join(s['refs'])}, chunks={s['chunks']})"
