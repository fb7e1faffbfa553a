"""Measure schedules on a local world of ranks and turn the timings into measurement-store records.

A schedule's time is the slowest rank's time of each iteration (every iteration starts after a
barrier), summarised by the median over iterations; per-stage times come from a trace of the last
iteration on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.inputs import make_inputs
from ..backends.torch.worker import step_time_ms, step_times, time_schedule
from ..errors import BackendError
from ..ir.graph import Program
from ..schedule.schedule import Schedule
from .store import MeasurementStore, provenance


@dataclass
class Measurement:
    """Timings of one schedule on one world size."""

    schedule: Schedule
    world_size: int
    total_ms: float  # median over iterations of the slowest rank's time
    times_ms: list[float]
    stage_ms: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.schedule.name


def time_on_rank(rank: int, world_size: int, schedule: Schedule, sizes: Mapping[str, int], seed: int,
                 device: str, iters: int, warmup: int) -> dict[str, Any]:
    """Run on every rank: make this rank's inputs here (nothing large crosses the pipes), time the schedule."""
    inputs = make_inputs(schedule.original, world_size, sizes, seed=seed)
    return time_schedule(rank, world_size, schedule, inputs, sizes, device, iters, warmup, trace=rank == 0)


def _stage_ms(events: Sequence[tuple]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, _stream, t0, t1, chunk in events:
        if chunk is None:
            out[name] = out.get(name, 0.0) + (t1 - t0) / 1e6
    return out


def summarise(schedule: Schedule, world_size: int, per_rank: list[dict[str, Any]]) -> Measurement:
    """Combine every rank's timings into one Measurement."""
    times = [r["times_ms"] for r in per_rank]
    return Measurement(schedule, world_size, step_time_ms(times), step_times(times), _stage_ms(per_rank[0]["events"]))


def measure_schedules(world: Any, schedules: Sequence[Schedule], sizes: Mapping[str, int], *, device: str = "cpu",
                      iters: int = 10, warmup: int = 3, rounds: int = 1, seed: int = 0, timeout_s: float = 300.0,
                      progress: Callable[[Schedule], None] | None = None) -> list[Measurement]:
    """Time each schedule on `world` (a live LocalWorld); one Measurement per schedule. With `rounds` > 1
    the schedules take turns, `iters` / `rounds` iterations each per round, so that a slow spell of a
    shared machine does not fall on one schedule only."""
    rounds = max(1, min(rounds, iters))
    per_schedule: list[list[dict[str, Any]]] = [[] for _ in schedules]
    for r in range(rounds):
        n = iters // rounds + (1 if r < iters % rounds else 0)
        for i, s in enumerate(schedules):
            if progress is not None:
                progress(s)
            try:
                per_rank = world.call(time_on_rank, (s, dict(sizes), seed, device, n, warmup), timeout_s=timeout_s)
            except BackendError as exc:
                raise BackendError(f"measuring schedule {s.name} on {world.world_size} ranks failed: {exc}") from None
            per_schedule[i].append(per_rank)
    out = []
    for s, runs in zip(schedules, per_schedule, strict=True):
        merged = [{"times_ms": [t for run in runs for t in run[rank]["times_ms"]], "events": runs[-1][rank]["events"]}
                  for rank in range(world.world_size)]
        out.append(summarise(s, world.world_size, merged))
    return out


def records(program: Program, sizes: Mapping[str, int], measurements: Sequence[Measurement], *, backend: str,
            device: str, source: str, predictions: Mapping[str, Any] | None = None,
            extra: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Store records for measurements; `predictions` maps a schedule name to its costmodel.Prediction
    (kept in `extra` so the learned correction can train on it)."""
    prov = provenance()
    out = []
    for m in measurements:
        more: dict[str, Any] = {"source": source, "times_ms": m.times_ms, **(extra or {})}
        pred = (predictions or {}).get(m.name)
        if pred is not None:
            more |= {"predicted_ms": pred.total_ms, "features": pred.features}
        out.append({"program": program.name, "program_fingerprint": program.fingerprint(), "schedule": m.name,
                    "schedule_fingerprint": m.schedule.fingerprint(), "sizes": dict(sizes),
                    "world_size": m.world_size, "backend": backend, "device": device,
                    "stage_times_ms": m.stage_ms, "total_ms": m.total_ms, "iters": len(m.times_ms),
                    "extra": more, **prov})
    return out


def record(store: MeasurementStore | None, program: Program, sizes: Mapping[str, int],
           measurements: Sequence[Measurement], **kwargs: Any) -> None:
    """Append the records of `measurements` to `store` (nothing if store is None)."""
    if store is not None and measurements:
        store.append(records(program, sizes, measurements, **kwargs))


def open_world(world_size: int, device: str = "cpu", timeout_s: float = 300.0,
               wall_timeout_s: float | None = None) -> Any:
    """A LocalWorld for measuring on `device` ("cpu": Gloo; "cuda": NCCL with a GPU per rank, else Gloo), with a
    per-wait timeout and an optional limit on each call's wall time."""
    from ..launch import LocalWorld

    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise BackendError(f"device must be cpu or cuda, got {device!r}")
    return LocalWorld(world_size, backend="auto" if kind == "cuda" else "gloo", device=kind, timeout_s=timeout_s,
                      wall_timeout_s=wall_timeout_s)
