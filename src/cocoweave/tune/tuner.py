"""The autotuner: predict every schedule, measure the best k and the baseline, pick the fastest measured.

The baseline (the program as written) is always among the candidates and always measured, even when the caller's
`schedules` leave it out, and only a finite measurement can be chosen, so the choice is never slower than the
baseline as measured in the same run. Without a cost model every schedule is measured. Measuring is injected
(`measure`: schedules -> Measurements), so the choice logic is testable without ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CocoweaveError
from ..ir.graph import Program
from ..perf.measure import Measurement
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from .cache import TuneCache, cache_key

Predict = Callable[[Schedule], float]
Measure = Callable[[Sequence[Schedule]], Sequence[Measurement]]


@dataclass
class Candidate:
    """One schedule: its prediction (None without a model), its measurement (None if not measured)."""

    schedule: Schedule
    predicted_ms: float | None
    measured: Measurement | None = None

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def measured_ms(self) -> float | None:
        return None if self.measured is None else self.measured.total_ms


@dataclass
class TuneResult:
    """Every candidate (ranked by prediction), the baseline and the choice."""

    program: Program
    candidates: list[Candidate]
    baseline: Candidate
    choice: Candidate
    key: str
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """Baseline time / chosen time, both as measured in this run."""
        return self.baseline.measured_ms / self.choice.measured_ms

    def measured(self) -> list[Candidate]:
        return [c for c in self.candidates if c.measured is not None]


def select_to_measure(candidates: Sequence[Candidate], baseline: Candidate, k: int) -> list[Candidate]:
    """The k best predicted candidates plus the baseline (all of them when nothing is predicted)."""
    if any(c.predicted_ms is None for c in candidates):
        return list(candidates)
    ranked = sorted(candidates, key=lambda c: c.predicted_ms)
    chosen = ranked[:max(k, 1)]
    if baseline not in chosen:
        chosen.append(baseline)
    return chosen


def tune(program: Program, sizes: Mapping[str, int], world_size: int, *, measure: Measure,
         predict: Predict | None = None, k: int = 3, backend: str = "torch", device: str = "cpu",
         schedules: Sequence[Schedule] | None = None, cache: TuneCache | None = None,
         cache_extra: Mapping[str, Any] | None = None) -> TuneResult:
    """Tune `program` for `world_size` ranks: measure the top-k predicted schedules and the baseline, choose
    the fastest measured and (if `cache` is given) cache that choice."""
    found = list(schedules) if schedules is not None else enumerate_schedules(program, device)
    if not any(not s.steps for s in found):  # the program as written is always a candidate
        found.insert(0, Schedule(program))
    candidates = [Candidate(s, predict(s) if predict is not None else None) for s in found]
    baseline = next(c for c in candidates if not c.schedule.steps)
    to_measure = select_to_measure(candidates, baseline, k)
    results = measure([c.schedule for c in to_measure])
    if len(results) != len(to_measure):
        raise CocoweaveError(f"the measuring function returned {len(results)} measurements for "
                             f"{len(to_measure)} schedules.")
    for c, m in zip(to_measure, results, strict=True):
        c.measured = m
    choice = baseline  # a schedule is chosen only when it measured faster than the program as written
    if _finite(baseline.measured_ms):
        choice = min((c for c in to_measure if _finite(c.measured_ms)),
                     key=lambda c: (c.measured_ms, c is not baseline))
    key = cache_key(program, sizes, world_size, backend, device)
    ranked = sorted(candidates, key=lambda c: (c.predicted_ms is None, c.predicted_ms or 0.0))
    result = TuneResult(program, ranked, baseline, choice, key)
    if not _finite(baseline.measured_ms):
        result.notes.append(f"the program as written measured {baseline.measured_ms} ms: it stays the choice, as no "
                            "schedule can be shown to be faster.")
    if predict is None:
        result.notes.append("no cost model for this world size: every schedule was measured "
                            "(run `cocoweave perf calibrate` to predict first).")
    if cache is not None:
        cache.put(key, cache_entry(result, cache_extra))
    return result


def _finite(ms: float | None) -> bool:
    return ms is not None and math.isfinite(ms)


def cache_entry(result: TuneResult, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the tuning cache keeps of a result: the choice (its steps rebuild it), what was measured, `extra`."""
    choice = result.choice
    return {"program": result.program.name, "schedule": choice.name, "fingerprint": choice.schedule.fingerprint(),
            "steps": choice.schedule.steps_json(), "measured_ms": choice.measured_ms,
            "baseline_ms": result.baseline.measured_ms, "predicted_ms": choice.predicted_ms,
            "measured": {c.name: c.measured_ms for c in result.measured()}, **(extra or {})}
