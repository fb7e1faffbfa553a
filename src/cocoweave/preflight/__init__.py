"""Pre-flight: before a pipeline job takes its machines, prove from its schedule that one training step's
communication matches up and cannot wait in a circle, predict each rank's peak memory against its device and the
schedule's idle share, all without tensors.

    report = preflight(PipelineJob(pp=2, tp=2, microbatches=4, n_blocks=4, batch=8, seq=8, d_model=16))
    report.bubble(0), report.memory[0].total      # PreflightError (one sentence) if it would hang or not fit

What it proves and what it does not: docs/preflight.md."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ParallelConfigError
from .check import Timing, check_trace
from .job import PipelineJob, count_params, job_of, mesh_position, read_schedule_csv
from .memory import RankMemory, check_fits, rank_memory
from .predict import layout, predict, stage_split
from .record import Recording, recording
from .trace import Event, Op, Trace, compare


@dataclass
class Report:
    """A job that passed: its predicted trace, the simulated step and each rank's predicted peak memory."""

    job: PipelineJob
    trace: Trace
    timing: Timing
    memory: dict[int, RankMemory]
    seconds: float

    def bubble(self, rank: int) -> float:
        """The share of the step `rank` is idle (the schedule's bubble; with the job's link, its receives too)."""
        return self.timing.bubble(rank)

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job.name, "ranks": self.job.world, "ok": True, "seconds": round(self.seconds, 3),
                "bubble": {str(r): round(self.bubble(r), 4) for r in self.trace.ranks},
                "max_bubble": round(self.timing.max_bubble, 4),
                "memory": {str(r): m.to_json() for r, m in self.memory.items()},
                "device_memory": self.job.device_memory,
                "operations": {str(r): len(self.trace.ops.get(r, [])) for r in self.trace.ranks},
                "trace": self.trace.to_json()["ranks"]}


def preflight(job: PipelineJob, ranks: list[int] | None = None, one_replica: bool = False) -> Report:
    """Check `job` (all ranks; `ranks` limits the memory check to those, [] skips it): PreflightError with one
    sentence if a step would hang or not fit `job.device_memory`, ParallelConfigError if the job cannot be
    described. `one_replica` checks the pipeline of one dp x tp replica only (every replica issues the same
    operations over its own mirror-image groups), whose cost does not grow with dp and tp."""
    start = time.perf_counter()
    if one_replica:
        job = dataclasses.replace(job, dp=1, tp=1, optimizer_steps=None, name=f"{job.name} (one replica)")
    num_stages, _ = layout(job)
    split = stage_split(job, num_stages)
    trace = predict(job)
    timing = check_trace(trace, (lambda op: job.receive_cost(op.numel, op.dtype)) if job.link is not None else None)
    memory: dict[int, RankMemory] = {}
    try:
        for r in trace.ranks if ranks is None else ranks:
            memory[r] = rank_memory(job, trace, r, split)
    except ValueError as e:  # the planner's spec refuses the sizes (pydantic's ValidationError is a ValueError)
        raise ParallelConfigError(f"the job's model sizes cannot be modelled: {str(e).splitlines()[0]}") from None
    if job.device_memory is not None:
        for m in memory.values():
            check_fits(m, float(job.device_memory), trace.step)
    return Report(job, trace, timing, memory, time.perf_counter() - start)


__all__ = ["Event", "Op", "PipelineJob", "RankMemory", "Recording", "Report", "Timing", "Trace", "check_fits",
           "check_trace", "compare", "count_params", "job_of", "mesh_position", "predict", "preflight", "rank_memory",
           "read_schedule_csv", "recording"]
