"""Functions each rank runs inside a LocalWorld or under torchrun: check schedules, time them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...plan import lower
from ...schedule.schedule import Schedule
from ..inputs import RankInputs
from ..reference import RankResult
from .executable import Executable


def _to(inputs: RankInputs, device: torch.device) -> dict[str, Any]:
    return {k: v.to(device).clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def run_schedules(rank: int, world_size: int, schedules: Sequence[Schedule], inputs: Sequence[RankInputs],
                  sizes: Mapping[str, int], device: str = "cpu", kernels: str = "auto") -> list[RankResult]:
    """Run each schedule once on this rank's inputs; results on the CPU, sliced state gathered whole.
    `kernels` picks how fused stages compute (Executable's "auto", "triton" or "torch")."""
    dev = torch.device(device)
    out = []
    for s in schedules:
        plan = lower(s)
        exe = Executable(plan, rank, world_size, sizes, dev, kernels=kernels)
        res = exe.run(_to(inputs[rank], dev))
        state = {}
        for name, t in res.state.items():
            state[name] = (exe.gather_state(name) if name in plan.sliced_state else t).detach().cpu().clone()
        out.append(RankResult({n: t.detach().cpu().clone() for n, t in res.outputs.items()}, state))
    return out


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


def time_schedule(rank: int, world_size: int, schedule: Schedule, inputs: Sequence[RankInputs],
                  sizes: Mapping[str, int], device: str = "cpu", iters: int = 20, warmup: int = 3,
                  trace: bool = False) -> dict[str, Any]:
    """Step times of one schedule on this rank (ms, after a barrier each), and trace events of the last step."""
    dev = torch.device(device)
    exe = Executable(lower(schedule), rank, world_size, sizes, dev)
    given = _to(inputs[rank], dev)
    times = timed_steps(lambda: exe.run(given), world_size, dev, iters, warmup,
                        before=lambda i: exe.trace(trace and i == warmup + iters - 1))
    return {"times_ms": times, "events": list(exe.ctx.events)}


def trace_events(rank: int, spans: Sequence[tuple[str, str, int, int, int | None]]) -> list[dict[str, Any]]:
    """RankContext spans (name, stream, start ns, end ns, chunk) as cocoweave.trace events."""
    return [{"name": name, "rank": rank, "stream": stream, "start_ns": t0, "dur_ns": t1 - t0, "chunk": chunk,
             "args": {}} for name, stream, t0, t1, chunk in spans]


def run_and_time(rank: int, world_size: int, schedule: Schedule, inputs: Sequence[RankInputs],
                 sizes: Mapping[str, int], device: str = "cpu", iters: int = 0,
                 trace: bool = False) -> dict[str, Any]:
    """What `cocoweave run --backend torch` does on each rank: one step on the inputs (results on the
    CPU, sliced state whole), then `iters` timed steps (one more, traced, with `trace`)."""
    result = run_schedules(rank, world_size, [schedule], inputs, sizes, device)[0]
    timed: dict[str, Any] = {"times_ms": [], "events": []}
    if iters or trace:
        timed = time_schedule(rank, world_size, schedule, inputs, sizes, device, iters=max(iters, 1), trace=trace)
    return {"result": result, "times_ms": timed["times_ms"], "events": trace_events(rank, timed["events"])}
