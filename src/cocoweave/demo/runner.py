"""The demo's work: for each paper workload, enumerate its schedules, check every one against the program as
written (reference backend, and the torch backend on the live world), time every one and the plain torch
baseline on a local world, and trace the fastest.

Checks run at small sizes (`check_sizes`: the reference backend simulates every rank in one process),
timings at the workload's `sizes`; a schedule is one list of steps replayed onto both programs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.inputs import make_inputs
from ..backends.torch.worker import run_schedules, step_time_ms, time_schedule, trace_events
from ..check import check_schedules, world_applicable
from ..ir.graph import Program
from ..launch import rank_state
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from ..workloads import adam, boundary, layer
from .baselines import BASELINES


@dataclass(frozen=True)
class Workload:
    """One of the paper's workloads: its program, sizes and plain baseline."""

    key: str
    title: str
    baseline: str  # what the plain torch baseline does
    build: Callable[..., Program]
    sizes: dict[str, int]
    quick_sizes: dict[str, int]
    half: bool = False  # fp16 on GPUs as in the paper; fp32 on CPUs, where fp16 matmuls are emulated (~100x slower)

    def program(self, sizes: dict[str, int], device: str) -> Program:
        """The workload's program at `sizes` for `device`."""
        return self.build(**sizes, **({"dtype": "float16" if device == "cuda" else "float32"} if self.half else {}))


WORKLOADS: dict[str, Workload] = {w.key: w for w in (
    Workload("adam", "data-parallel Adam", "AllReduce + torch.optim.Adam(foreach)", adam,
             {"N": 1 << 20}, {"N": 4096}),
    Workload("model_parallel", "Megatron row-parallel layer", "matmul + AllReduce + eager epilogue", layer,
             {"B": 8, "S": 128, "H": 512}, {"B": 2, "S": 8, "H": 64}, half=True),
    Workload("pipeline_parallel", "pipeline-stage boundary", "AllReduce + eager epilogue + full send",
             boundary, {"B": 8, "S": 128, "H": 512}, {"B": 2, "S": 8, "H": 64}, half=True),
)}
CHECK_SIZES = {"adam": {"N": 4096}, "model_parallel": {"B": 2, "S": 8, "H": 64},
               "pipeline_parallel": {"B": 2, "S": 8, "H": 64}}


@dataclass
class Row:
    """One schedule of one workload: its median step time (max over ranks) and its checks."""

    schedule: str
    steps: list[dict[str, Any]]
    ms: float = math.nan
    speedup: float = math.nan  # baseline ms / ms
    reference_ok: bool = False
    torch_ok: bool = False
    max_abs: float = math.nan
    error: str | None = None

    @property
    def checked(self) -> bool:
        return self.reference_ok and self.torch_ok


@dataclass
class WorkloadResult:
    """Everything measured for one workload."""

    key: str
    title: str
    baseline: str
    sizes: dict[str, int]
    check_sizes: dict[str, int]
    dtype: str
    baseline_ms: float = math.nan
    rows: list[Row] = field(default_factory=list)
    skipped: str | None = None

    @property
    def fastest(self) -> Row | None:
        timed = [r for r in self.rows if r.checked and math.isfinite(r.ms)]
        return min(timed, key=lambda r: r.ms) if timed else None


# ---------------------------------------------------------------------------------------------------------
# Functions the ranks run
# ---------------------------------------------------------------------------------------------------------


def _rank_inputs(program: Program, world_size: int) -> list[dict[str, Any]]:
    """Random inputs of `program` for every rank (seed 0: the same on every rank), kept for the next call."""
    cache = rank_state().setdefault("demo_inputs", {})
    key = (program.fingerprint(), world_size)
    if key not in cache:
        cache.clear()
        cache[key] = make_inputs(program, world_size, {}, seed=0)
    return cache[key]


def run_on_rank(rank: int, world_size: int, schedules: Sequence[Schedule], device: str) -> list[Any]:
    """Every schedule once on the torch backend (results whole, on the CPU): for the equivalence check."""
    inputs = make_inputs(schedules[0].original, world_size, {}, seed=0)
    return run_schedules(rank, world_size, schedules, inputs, {}, device)


def time_on_rank(rank: int, world_size: int, schedule: Schedule, device: str, iters: int, warmup: int,
                 trace: bool = False) -> dict[str, Any]:
    """Step times of one schedule on this rank, and its trace events (last step) with `trace`."""
    res = time_schedule(rank, world_size, schedule, _rank_inputs(schedule.original, world_size), {}, device,
                        iters=iters, warmup=warmup, trace=trace)
    return {"times_ms": res["times_ms"], "events": trace_events(rank, res["events"]) if trace else []}


# ---------------------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------------------


def check_workload(world: Any, wl: Workload, schedules: list[Schedule], device: str, sizes: dict[str, int],
                   result: WorkloadResult) -> None:
    """Check every schedule at `sizes` on the reference backend, then on the torch backend of `world`."""
    program = wl.program(sizes, device)
    small = [Schedule(program, s.steps) for s in schedules]
    ws = world.world_size
    ref_rows = check_schedules(program, small, ws)
    per_rank = world.run(run_on_rank, small, device)
    index = {id(s): i for i, s in enumerate(small)}
    torch_rows = check_schedules(program, small, ws,
                                 runner=lambda s, _inputs, _sizes: [per_rank[r][index[id(s)]] for r in range(ws)])
    for row, ref, tor in zip(result.rows, ref_rows, torch_rows, strict=True):
        row.reference_ok, row.torch_ok = ref.ok, tor.ok
        row.max_abs = max(ref.max_abs, tor.max_abs)
        row.error = ref.error or tor.error or (None if ref.ok and tor.ok else
                                               f"differs from the program as written by {row.max_abs:.2e}")


def run_workload(world: Any, wl: Workload, *, quick: bool, iters: int, warmup: int, device: str,
                 advance: Callable[[str], None], on_total: Callable[[int], None]) -> tuple[WorkloadResult, list]:
    """Check, time and trace one workload; returns its result and the trace events per rank."""
    ws = world.world_size
    sizes = wl.quick_sizes if quick else wl.sizes
    check_sizes = wl.quick_sizes if quick else CHECK_SIZES[wl.key]
    program = wl.program(sizes, device)
    dtype = {v.dtype for v in program.tensor_inputs}
    result = WorkloadResult(wl.key, wl.title, wl.baseline, dict(sizes), dict(check_sizes), "/".join(sorted(dtype)))
    why = world_applicable(program, ws)
    if why is not None or (wl.key == "pipeline_parallel" and ws < 2):
        result.skipped = why or "the pipeline needs two stages, so at least 2 ranks"
        return result, []
    schedules = enumerate_schedules(program)
    on_total(len(schedules) + 3)
    result.rows = [Row(s.name, s.steps_json()) for s in schedules]
    advance(f"{wl.key}: checking {len(schedules)} schedules")
    check_workload(world, wl, schedules, device, check_sizes, result)
    advance(f"{wl.key}: baseline")
    baseline_kwargs = {} if wl.key == "adam" else {"dtype": program.inputs["b"].dtype}
    result.baseline_ms = step_time_ms(world.run(BASELINES[wl.key], sizes, iters, warmup, **baseline_kwargs))
    for s, row in zip(schedules, result.rows):
        advance(f"{wl.key}: {s.name}")
        if row.checked:  # a schedule that computes something else is not worth timing
            row.ms = step_time_ms([r["times_ms"] for r in world.run(time_on_rank, s, device, iters, warmup)])
            row.speedup = result.baseline_ms / row.ms
    events: list = []
    best = result.fastest
    advance(f"{wl.key}: tracing {best.schedule if best else 'nothing'}")
    if best is not None:
        s = schedules[[r.schedule for r in result.rows].index(best.schedule)]
        per_rank = world.run(time_on_rank, s, device, 1, 1, True)
        events = [[dict(e, stream=f"{wl.key} {e['stream']}", args={**e["args"], "schedule": s.name})
                   for e in r["events"]] for r in per_rank]
    return result, events


@dataclass
class DemoResult:
    """The whole demo: per-workload results, trace events per rank, and how it ran."""

    workloads: list[WorkloadResult]
    events: list[list[dict[str, Any]]]
    world_size: int
    device: str
    backend: str
    iters: int
    warmup: int
    quick: bool
    start_s: float = 0.0  # starting the world
    total_s: float = 0.0


def run_demo(world: Any, keys: Sequence[str], *, quick: bool, iters: int, warmup: int,
             advance: Callable[[str], None] = lambda _: None, on_total: Callable[[int], None] = lambda _: None,
             on_workload: Callable[[WorkloadResult], None] = lambda _: None) -> DemoResult:
    """Run the demo's workloads `keys` on a started world; `advance` is called before each unit of work,
    `on_total` with the number of units a workload adds, `on_workload` with each finished workload."""
    start = time.perf_counter()
    results, events = [], [[] for _ in range(world.world_size)]
    for key in keys:
        res, ev = run_workload(world, WORKLOADS[key], quick=quick, iters=iters, warmup=warmup,
                               device=world.device, advance=advance, on_total=on_total)
        for r, e in enumerate(ev):
            events[r] += e
        results.append(res)
        on_workload(res)
    return DemoResult(results, events, world.world_size, world.device, world.backend, iters, warmup, quick,
                      total_s=time.perf_counter() - start)
