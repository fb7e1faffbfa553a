"""Schedule steps as typed objects (as TVM's instruction kinds): each kind maps a schedule's program and stages to
new ones (a pure function: the Schedule records the step and keeps the result), prints itself and round-trips
through JSON.

Graph rewrites (Split, Reorder, AsSlice) change the program and must come before the groupings (Fuse,
Overlap, Algorithm), which group its stages. Adding a step kind is one class and one entry in `STEPS`.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ScheduleError
from . import stages as st
from .as_slice import as_slice
from .reorder import reorder
from .split import split, split_names

if TYPE_CHECKING:
    from ..ir.graph import Program
    from .schedule import Schedule
    from .stages import Stage

_TYPES: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    str: ("a string", lambda v: isinstance(v, str)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    tuple[str, ...]: ("a list of strings", lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v)),
    tuple[int, ...] | None: ("a list of positive integers or null", lambda v: v is None or (
        isinstance(v, tuple) and len(v) > 0 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                    for x in v))),
}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Step:
    """One recorded transformation of a schedule; `kind` is its name in JSON ("split", "fuse", ...)."""

    kind: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):  # JSON has lists where the step keeps tuples
                object.__setattr__(self, f.name, v := tuple(v))
            what, ok = _TYPES[_hints(type(self))[f.name]]
            if not ok(v):
                raise ScheduleError(f"schedule step {self.kind} has {f.name}={v!r}, but its {f.name} must be {what}")

    def apply(self, schedule: Schedule) -> Any:
        """Do this step's work on `schedule` (without recording it); returns what the Schedule method returns."""
        return schedule.advance(self)

    def map(self, program: Program, stages: list[Stage], done: Sequence[Step]) -> tuple[Program, list[Stage]]:
        """This step's work on a schedule's `program` and `stages` (after the steps `done`): the new program and
        stages; ScheduleError when the step does not apply."""
        raise NotImplementedError

    def result(self, schedule: Schedule) -> Any:
        """What the Schedule method returns, read from `schedule` once the step is applied."""
        return None

    def to_json(self) -> dict[str, Any]:
        """{"step": kind, field: value, ...} in field order (the saved form of schedules and tune caches); a field
        left at a default of None is left out (so that steps saved before it existed read and hash the same)."""
        return {"step": self.kind} | {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                                      if not (f.default is None and getattr(self, f.name) is None)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Step:
        """The step a `to_json` dict describes; ScheduleError for an unknown kind or a malformed dict."""
        if not isinstance(data, Mapping):
            raise ScheduleError(f"schedule step {data!r} is not a JSON object")
        kind = data.get("step")
        step_cls = STEPS.get(kind) if isinstance(kind, str) else None
        if step_cls is None:
            raise ScheduleError(f"unknown schedule step {kind!r} in {dict(data)!r}; the kinds are "
                                + ", ".join(STEPS))
        names = [f.name for f in fields(step_cls)]
        missing = [f.name for f in fields(step_cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise ScheduleError(f"schedule step {dict(data)!r} lacks its {missing[0]!r} field")
        extra = [k for k in data if k != "step" and k not in names]
        if extra:
            raise ScheduleError(f"schedule step {dict(data)!r} has a field {extra[0]!r} that a {kind} step does not "
                                f"have (its fields are {', '.join(names)})")
        return step_cls(**{k: v for k, v in data.items() if k != "step"})


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


# -- graph rewrites -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rewrite(Step):
    """A step that rewrites the program; it resets the stages, so it must come before any Grouping."""

    def map(self, program: Program, stages: list[Stage], done: Sequence[Step]) -> tuple[Program, list[Stage]]:
        if any(isinstance(s, Grouping) for s in done):
            raise ScheduleError(f"{self.kind} must come before fuse and overlap and algorithm choices: it changes "
                                "the stages they group")
        program = self.rewrite(program)
        return program, st.base_stages(program)

    def rewrite(self, program: Program) -> Program:
        """The rewritten program."""
        raise NotImplementedError


@dataclass(frozen=True)
class Split(Rewrite):
    """AllReduce `ref` -> ReduceScatter + AllGather along `dim` (over the same mesh axis), the scattered parts in
    proportion to `shares` when given; returns the two new stages."""

    ref: str
    dim: int = 0
    shares: tuple[int, ...] | None = None
    kind: ClassVar[str] = "split"

    def rewrite(self, program: Program) -> Program:
        return split(program, self.ref, self.dim, self.shares)[0]

    def result(self, schedule: Schedule) -> tuple[Stage, Stage]:
        rs, ag = split_names(self.ref)
        return schedule.stage(rs), schedule.stage(ag)

    def __str__(self) -> str:
        return f"split({self.ref}, dim={self.dim}" + (f", shares={self.shares})" if self.shares else ")")


@dataclass(frozen=True)
class Reorder(Rewrite):
    """Move the computation after AllGather `ref` onto slices, before it; returns the stages from the first
    moved computation on."""

    ref: str
    kind: ClassVar[str] = "reorder"

    def rewrite(self, program: Program) -> Program:
        return reorder(program, self.ref)

    def result(self, schedule: Schedule) -> list[Stage]:
        stages = schedule.stages
        rs = self.ref[:-3] + ".rs" if self.ref.endswith(".ag") else None
        start = st.locate(stages, rs) + 1 if rs and any(rs in s.values for s in stages) else 0
        return stages[start:]

    def __str__(self) -> str:
        return f"reorder({self.ref})"


@dataclass(frozen=True)
class AsSlice(Rewrite):
    """Store state tensor `name` sliced (1/p memory); its whole-tensor AllGather disappears."""

    name: str
    kind: ClassVar[str] = "as_slice"

    def rewrite(self, program: Program) -> Program:
        return as_slice(program, self.name)

    def __str__(self) -> str:
        return f"as_slice({self.name})"


# -- stage groupings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Grouping(Step):
    """A step that groups or configures the stages of the rewritten program; returns the stage it made."""

    def map(self, program: Program, stages: list[Stage], done: Sequence[Step]) -> tuple[Program, list[Stage]]:
        return program, self.group(program, stages)

    def group(self, program: Program, stages: list[Stage]) -> list[Stage]:
        """The regrouped stages."""
        raise NotImplementedError

    def result(self, schedule: Schedule) -> Stage:
        return schedule.stage(self.anchor)

    @property
    def anchor(self) -> str:
        """The value naming the stage this step makes or configures."""
        raise NotImplementedError


@dataclass(frozen=True)
class Fuse(Grouping):
    """Consecutive stages `refs` become one; returns it."""

    refs: tuple[str, ...]
    kind: ClassVar[str] = "fuse"

    def group(self, program: Program, stages: list[Stage]) -> list[Stage]:
        return st.fuse(program, stages, self.refs)

    @property
    def anchor(self) -> str:
        return self.refs[0]

    def __str__(self) -> str:
        return f"fuse({', '.join(self.refs)})"


@dataclass(frozen=True)
class Overlap(Grouping):
    """The producer/consumer chain `refs` runs in `chunks` chunks; returns the overlapped stage."""

    refs: tuple[str, ...]
    chunks: int
    kind: ClassVar[str] = "overlap"

    def group(self, program: Program, stages: list[Stage]) -> list[Stage]:
        return st.overlap(program, stages, self.refs, self.chunks)

    @property
    def anchor(self) -> str:
        return self.refs[0]

    def __str__(self) -> str:
        return f"overlap({', '.join(self.refs)}, chunks={self.chunks})"


@dataclass(frozen=True)
class Algorithm(Grouping):
    """Collective or fused RS-C-AG stage `ref` runs on collective algorithm `algorithm`; returns the stage."""

    ref: str
    algorithm: str
    kind: ClassVar[str] = "algorithm"

    def group(self, program: Program, stages: list[Stage]) -> list[Stage]:
        return st.set_algorithm(program, stages, self.ref, self.algorithm)

    @property
    def anchor(self) -> str:
        return self.ref

    def __str__(self) -> str:
        return f"algorithm({self.ref}, {self.algorithm!r})"


STEPS: dict[str, type[Step]] = {cls.kind: cls for cls in (Split, Reorder, AsSlice, Fuse, Overlap, Algorithm)}
"""Every step kind by its JSON name: the one table `Step.from_json` dispatches through."""
