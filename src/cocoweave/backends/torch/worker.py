"""Functions each rank runs inside a LocalWorld or under torchrun: check schedules, time them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...plan import lower
from ...schedule.schedule import Schedule
from ..inputs import RankInputs
from ..results import RankResult
from .executable import Executable


def _to(inputs: RankInputs, device: torch.device) -> dict[str, Any]:
    return {k: v.to(device).clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def run_schedules(rank: int, world_size: int, schedules: Sequence[Schedule], inputs: Sequence[RankInputs],
                  sizes: Mapping[str, int], device: str = "cpu", kernels: str | None = None) -> list[RankResult]:
    """Run each schedule once on this rank's inputs; results on the CPU, sliced state gathered whole.
    `kernels` picks how fused stages compute (Executable's "auto", "triton", "compiled" or "torch")."""
    dev = torch.device(device)
    return [_run_once(Executable(lower(s), rank, world_size, sizes, dev, kernels=kernels), inputs[rank])
            for s in schedules]


def _run_once(exe: Executable, inputs: RankInputs) -> RankResult:
    """One step of `exe` on a copy of `inputs`; results on the CPU, sliced state gathered whole."""
    res = exe.run(_to(inputs, exe.device))
    state = {}
    for name, t in res.state.items():
        state[name] = (exe.gather_state(name) if name in exe.plan.sliced_state else t).detach().cpu().clone()
    return RankResult({n: t.detach().cpu().clone() for n, t in res.outputs.items()}, state)


def timed_steps(step: Callable[[], Any], world_size: int, device: torch.device, iters: int, warmup: int,
                before: Callable[[int], None] | None = None) -> list[float]:
    """Milliseconds of each of `iters` calls of `step` after `warmup` calls: a barrier before each (so the
    ranks start together) and CUDA synchronised around it. `before(i)` runs ahead of call i, untimed."""
    times = []
    for i in range(warmup + iters):
        if world_size > 1:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def step_times(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """The time of each timed step of a run: the slowest rank's (every step starts after a barrier)."""
    return [max(step) for step in zip(*per_rank, strict=True)]


def step_time_ms(per_rank: Sequence[Sequence[float]]) -> float:
    """The step time of a run, the one definition that measure, tune, the demo and `run --iters` report: the
    median over steps of the slowest rank's time of each step (`timed_steps` on every rank)."""
    return statistics.median(step_times(per_rank))


def time_schedule(rank: int, world_size: int, schedule: Schedule, inputs: Sequence[RankInputs],
                  sizes: Mapping[str, int], device: str = "cpu", iters: int = 20, warmup: int = 3,
                  trace: bool = False) -> dict[str, Any]:
    """Step times of one schedule on this rank (ms, after a barrier each), and trace events of the last step."""
    exe = Executable(lower(schedule), rank, world_size, sizes, torch.device(device))
    return _time(exe, inputs[rank], world_size, iters, warmup, trace)


def _time(exe: Executable, inputs: RankInputs, world_size: int, iters: int, warmup: int,
          trace: bool) -> dict[str, Any]:
    given = _to(inputs, exe.device)
    times = timed_steps(lambda: exe.run(given), world_size, exe.device, iters, warmup,
                        before=lambda i: exe.trace(trace and i == warmup + iters - 1))
    return {"times_ms": times, "events": list(exe.ctx.events)}


def trace_events(rank: int, spans: Sequence[tuple[str, str, int, int, int | None]]) -> list[dict[str, Any]]:
    """RankContext spans (name, stream, start ns, end ns, chunk) as cocoweave.perf.trace events."""
    return [{"name": name, "rank": rank, "stream": stream, "start_ns": t0, "dur_ns": t1 - t0, "chunk": chunk,
             "args": {}} for name, stream, t0, t1, chunk in spans]


def run_and_time(rank: int, world_size: int, schedule: Schedule, inputs: Sequence[RankInputs],
                 sizes: Mapping[str, int], device: str = "cpu", iters: int = 0,
                 trace: bool = False) -> dict[str, Any]:
    """What `cocoweave run --backend torch` does on each rank: one step on the inputs (results on the
    CPU, sliced state whole), then `iters` timed steps (one more, traced, with `trace`)."""
    exe = Executable(lower(schedule), rank, world_size, sizes, torch.device(device))  # built once, for both
    result = _run_once(exe, inputs[rank])
    timed: dict[str, Any] = {"times_ms": [], "events": []}
    if iters or trace:
        timed = _time(exe, inputs[rank], world_size, max(iters, 1), 3, trace)
    return {"result": result, "times_ms": timed["times_ms"], "events": trace_events(rank, timed["events"])}
