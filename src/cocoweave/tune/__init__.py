"""The autotuner: predict every schedule, measure the best few and the baseline, cache the fastest; and `choose`,
the one answer to schedule="auto" (the compiler's, the optimizers', the tensor-parallel layers').

The cache (`cached_schedule`, what `choose` consults) imports no measurement machinery; the tuner itself (`tune`,
which measures and reads the Parquet store: pandas, pyarrow) loads on first use, so that looking up a cached choice
does not cost a training process ~70 MiB of modules it never runs.

    choose(program, Context(world_size, device), fallback)

answers in this order: the choice this process already made for the same program and place (`Context.keep`), the
tuner's cached choice (`cocoweave tune`) where it may run here, else what the caller's `fallback` answers. Each
caller keeps its own fallback, on purpose: the compiler runs the program as written (with a warning), the
optimizers the schedule keeping the most state sliced, the layers measure their candidates live (`Measure`: the
fastest is kept in the tuning cache, and a later run takes it without measuring when every rank kept the same).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import CocoweaveError
from ..ir.graph import Program
from ..schedule.enumerate import schedules_of
from ..schedule.schedule import Schedule
from .cache import TuneCache, cache_key, cached_schedule

__all__ = ["Candidate", "Context", "Measure", "TuneCache", "TuneResult", "auto_schedule", "cache_key",
           "cached_schedule", "choose", "tune"]
_TUNER = ("Candidate", "TuneResult", "tune")

T = TypeVar("T", Schedule, str)


@dataclass(frozen=True)
class Context:
    """Where a program is to run (what a choice is kept by) and which kept choices apply there."""

    world_size: int
    device: str  # a device type ("cpu", "cuda")
    backend: str = "torch"
    sizes: Mapping[str, int] = field(default_factory=dict)
    cache: TuneCache | None = None  # the tuning cache (None: $COCOWEAVE_TUNE_CACHE or the state folder's)
    tuned: bool = True  # ask the tuner's cached choice first
    allowed: Collection[str] | None = None  # the schedules that may run here, by name (None: any)
    keep: Hashable = None  # not None: the answer is kept for this process by (program, world size, device, keep)


@dataclass(frozen=True)
class Measure(Generic[T]):
    """What a fallback answers to have `options` timed live: `fastest()` measures them (a collective: every rank of
    the group calls it together) and gives the fastest's index; `agree(index)` gives a remembered index when every
    rank of the group remembers the same (-1: none remembered here), else None. The measured choice is kept in the
    tuning cache under `key`."""

    key: str
    options: Sequence[T]
    names: Sequence[str]
    fastest: Callable[[], int]
    agree: Callable[[int], int | None]


_CHOSEN: dict[tuple, tuple[str, bool]] = {}  # this process's answers: key -> (name, whether a Schedule's)


def choose(program: Program, context: Context, fallback: Callable[[], T | Measure[T]]) -> T:
    """schedule="auto" for `program` in `context`: this process's earlier answer (with `context.keep`), else the
    tuner's cached choice (with `context.tuned`, where `context.allowed` has it), else `fallback()` (a Measure is
    measured, or taken from an earlier run's measurement)."""
    key = None if context.keep is None else (program.fingerprint(), context.world_size, context.device, context.keep)
    if key in _CHOSEN:
        name, is_schedule = _CHOSEN[key]
        return next(s for s in schedules_of(program) if s.name == name) if is_schedule else name
    found = cached_schedule(program, context.sizes, context.world_size, context.backend, context.device,
                            context.cache) if context.tuned else None
    if found is None or (context.allowed is not None and found.name not in context.allowed):
        answer = fallback()
        found = _measured(answer) if isinstance(answer, Measure) else answer
    if key is not None:
        _CHOSEN[key] = (found.name, True) if isinstance(found, Schedule) else (found, False)
    return found


def _measured(m: Measure[T]) -> T:
    """The option an earlier run measured fastest, when every rank remembers the same; else measured now (and kept
    for the next run)."""
    index = m.agree(_recall(m.key, m.names))
    if index is None:
        index = m.fastest()
        _remember(m.key, m.names[index])
    return m.options[index]


def _recall(key: str, names: Sequence[str]) -> int:
    """The index in `names` of the choice measured for `key` in an earlier run (the tuning cache, shared by the
    processes of this folder and across runs), -1 if none: the step's start-up then skips the measurement."""
    try:
        entry = TuneCache().get(key)
    except CocoweaveError:  # an unreadable cache is no memory; training goes on
        return -1
    choice = entry.get("schedule") if entry else None
    return list(names).index(choice) if choice in names else -1


def _remember(key: str, name: str) -> None:
    """Keep a measured choice for the next run (best effort: a cache that cannot be written is skipped)."""
    try:
        TuneCache().put(key, {"schedule": name, "source": "cocoweave.nn schedule='auto', measured in a step"})
    except CocoweaveError:
        pass


def auto_schedule(program: Program, sizes: Mapping[str, int], world_size: int, backend: str, device: str,
                  cache: TuneCache | None = None) -> Schedule:
    """The compiler's schedule="auto": the tuner's cached choice, else the program as written with a warning
    saying so."""
    def as_written() -> Schedule:
        warnings.warn(f"schedule='auto': no tuned schedule of {program.name} for world size {world_size} on "
                      f"{backend}/{device.split(':')[0]} in {(cache or TuneCache()).path}; running it as written "
                      f"(run `cocoweave tune` to choose one)", stacklevel=5)
        return Schedule(program)

    return choose(program, Context(world_size, device, backend, sizes, cache), as_written)


def __getattr__(name: str) -> Any:
    if name in _TUNER:
        from . import tuner

        return getattr(tuner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
