"""The demo's work, per paper workload:

1. enumerate its schedules and check each against the program as written on the reference backend (every rank
   simulated), on CHECK_INPUTS sets of random inputs (each with its own dropout seed) at small sizes;
2. time the plain PyTorch baselines;
3. per schedule, on the live world: build its executable once (fused stages compile here, on the route the
   executables take: $COCOWEAVE_KERNELS, else "auto"), check its first step against the program as written at the
   timed sizes (the torch backend, running the very code that is timed), time it with a new dropout seed every
   step, and trace one more step;
4. time the baselines again: each baseline's time is the lower of its two runs.

The headline of a workload is its fastest checked schedule that leaves the weights whole, against the strongest
(fastest) baseline. A schedule that keeps a weight sliced (`+slice(..., w)`) skips the all-gather the next forward
needs, so it is timed together with that all-gather (Executable.gather_state) and is never the headline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends import reference
from ..backends.inputs import make_inputs
from ..backends.results import RankResult
from ..backends.torch.executable import Executable, default_kernels
from ..backends.torch.worker import step_time_ms, timed_steps, trace_events
from ..equivalence.check import check_schedules, world_applicable
from ..equivalence.compare import compare_results
from ..ir.graph import Program
from ..launch import rank_state
from ..plan import lower
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from ..workloads import adam, boundary, layer
from .baselines import BASELINES, Baseline

CHECK_INPUTS = 3  # random input sets each schedule is checked on (reference backend, small sizes)
FIRST_SEED = 1000  # the dropout seed of the checked step; timed step i uses FIRST_SEED + 1 + i


@dataclass(frozen=True)
class Workload:
    """One of the paper's workloads: its program, sizes, the state its next step reads whole, its baselines."""

    key: str
    title: str
    build: Callable[..., Program]
    sizes: dict[str, int]
    quick_sizes: dict[str, int]
    check_sizes: dict[str, int]
    half: bool = False  # fp16 on GPUs as in the paper; fp32 on CPUs, where fp16 matmuls are emulated (~100x slower)
    whole: tuple[str, ...] = ()  # state the next step reads whole (the weights the forward needs)

    def program(self, sizes: dict[str, int], device: str) -> Program:
        """The workload's program at `sizes` for `device`."""
        return self.build(**sizes, **({"dtype": "float16" if device == "cuda" else "float32"} if self.half else {}))

    @property
    def baselines(self) -> tuple[Baseline, ...]:
        return BASELINES[self.key]


WORKLOADS: dict[str, Workload] = {w.key: w for w in (
    Workload("adam", "data-parallel Adam", adam, {"N": 1 << 20}, {"N": 4096}, {"N": 4096}, whole=("w",)),
    Workload("model_parallel", "Megatron row-parallel layer", layer, {"B": 8, "S": 128, "H": 512},
             {"B": 2, "S": 8, "H": 64}, {"B": 2, "S": 8, "H": 64}, half=True),
    Workload("pipeline_parallel", "pipeline-stage boundary", boundary, {"B": 8, "S": 128, "H": 512},
             {"B": 2, "S": 8, "H": 64}, {"B": 2, "S": 8, "H": 64}, half=True),
)}


@dataclass
class Row:
    """One schedule of one workload: its median step time (slowest rank) and its checks."""

    schedule: str
    steps: list[dict[str, Any]]
    gathers: list[str] = field(default_factory=list)  # state kept sliced that the next step reads whole: timed too
    ms: float = math.nan
    speedup: float = math.nan  # strongest baseline ms / ms
    reference_ok: bool = False  # on every one of the reference backend's input sets
    torch_ok: bool = False  # the torch backend's first step at the timed sizes
    max_abs: float = math.nan
    error: str | None = None
    build_s: float = math.nan  # building the executable and its first step (compiling fused stages), slowest rank

    @property
    def checked(self) -> bool:
        return self.reference_ok and self.torch_ok

    @property
    def keeps_weights_whole(self) -> bool:
        return not self.gathers


@dataclass
class BaselineRow:
    """One plain PyTorch baseline: the lower of its two runs (before and after the schedules)."""

    name: str
    ms: float = math.nan


@dataclass
class WorkloadResult:
    """Everything measured for one workload; `baseline` and `baseline_ms` are the strongest baseline's."""

    key: str
    title: str
    sizes: dict[str, int]
    check_sizes: dict[str, int]
    dtype: str
    baseline: str = ""
    baseline_ms: float = math.nan
    baselines: list[BaselineRow] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    skipped: str | None = None
    wall_s: float = 0.0  # checking, compiling and timing it

    @property
    def fastest(self) -> Row | None:
        """The headline: the fastest checked schedule that leaves the weights whole."""
        timed = [r for r in self.rows if r.checked and r.keeps_weights_whole and math.isfinite(r.ms)]
        return min(timed, key=lambda r: r.ms) if timed else None


# ---------------------------------------------------------------------------------------------------------
# Functions the ranks run
# ---------------------------------------------------------------------------------------------------------


def _rank_case(program: Program, world_size: int) -> tuple[list[dict[str, Any]], list[RankResult]]:
    """Random inputs of `program` for every rank (seed 0, the dropout seed FIRST_SEED) and the program as written's
    results on them (reference backend, state whole), kept for the workload's next schedule."""
    cache = rank_state().setdefault("demo_case", {})
    key = (program.fingerprint(), world_size)
    if key not in cache:
        cache.clear()
        inputs = make_inputs(program, world_size, {}, seed=0, scalars={"seed": FIRST_SEED})
        cache[key] = inputs, reference.run(program, inputs, {}, whole_state=True)
    return cache[key]


def _copy(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device).clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _first_step(exe: Executable, inputs: dict[str, Any]) -> RankResult:
    """One step on a copy of `inputs`: outputs and state on the CPU, state kept sliced gathered whole."""
    res = exe.run(_copy(inputs, exe.device))
    state = {n: (exe.gather_state(n) if n in exe.plan.sliced_state else t).cpu() for n, t in res.state.items()}
    return RankResult({n: t.cpu() for n, t in res.outputs.items()}, state)


def time_on_rank(rank: int, world_size: int, schedule: Schedule, device: str, iters: int, warmup: int,
                 gathers: Sequence[str]) -> dict[str, Any]:
    """This rank's part of one schedule: its executable built once; the first step compared with the program as
    written; `iters` timed steps after `warmup`, each with a new dropout seed and the all-gathers of `gathers`;
    one more step traced."""
    inputs, expected = _rank_case(schedule.original, world_size)
    start = time.perf_counter()
    exe = Executable(lower(schedule), rank, world_size, {}, torch.device(device))
    first = _first_step(exe, inputs[rank])  # fused stages compile here
    build_s = time.perf_counter() - start
    diff = compare_results(schedule.original, [first], [expected[rank]])
    # state kept sliced continues from the executable's own slices (given whole, it would be sliced again each step)
    given = _copy({k: v for k, v in inputs[rank].items() if k not in exe.plan.sliced_state}, exe.device)
    times = timed_run(exe, given, gathers, iters, warmup)
    return {"times_ms": times, "events": trace_events(rank, exe.ctx.events), "diff": (diff.max_abs, diff.ok),
            "build_s": build_s}


def timed_run(exe: Executable, given: dict[str, Any], gathers: Sequence[str], iters: int, warmup: int) -> list[float]:
    """`warmup` + `iters` steps of `exe` (the last `iters` timed, ms), then one more traced (exe.ctx.events). Step i
    runs with dropout seed FIRST_SEED + 1 + i (a fresh mask, as training needs) and all-gathers `gathers` (state
    kept sliced that the next step reads whole)."""

    def new_seed(i: int) -> None:
        if "seed" in given:
            given["seed"] = FIRST_SEED + 1 + i

    def step() -> None:
        exe.run(given)
        for name in gathers:
            exe.gather_state(name)

    times = timed_steps(step, exe.world_size, exe.device, iters, warmup, before=new_seed)
    new_seed(warmup + iters)
    exe.trace(True)
    step()
    exe.trace(False)
    return times


# ---------------------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------------------


def check_reference(program: Program, schedules: list[Schedule], world_size: int, rows: list[Row]) -> None:
    """Every schedule against the program as written on the reference backend, on CHECK_INPUTS random input sets
    (each with its own dropout seed). One thread: the tensors are small, and the ranks share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = [check_schedules(program, schedules, world_size, seed=k, scalars={"seed": 7919 * (k + 1)})
                 for k in range(CHECK_INPUTS)]
    finally:
        torch.set_num_threads(threads)
    for k, checked in enumerate(found):
        for row, c in zip(rows, checked, strict=True):
            row.reference_ok = c.ok if k == 0 else row.reference_ok and c.ok
            row.max_abs = max(row.max_abs, c.max_abs) if k else c.max_abs
            if not c.ok and row.error is None:
                row.error = c.error or f"reference: differs from the program as written by {c.max_abs:.2e} " \
                                       f"(input set {k})"


def time_baselines(world: Any, wl: Workload, sizes: dict[str, int], dtype: str, iters: int, warmup: int,
                   result: WorkloadResult, advance: Callable[[str], None]) -> None:
    """Time each baseline once more; keep the lower time of its runs, and the strongest baseline."""
    if not result.baselines:
        result.baselines = [BaselineRow(b.name) for b in wl.baselines]
    for b, row in zip(wl.baselines, result.baselines, strict=True):
        advance(f"{wl.key}: baseline {b.name}")
        ms = step_time_ms(world.run(b.run, sizes, iters, max(warmup, 1), dtype))  # the first call compiles
        row.ms = ms if math.isnan(row.ms) else min(row.ms, ms)
    best = min(result.baselines, key=lambda r: r.ms)
    result.baseline, result.baseline_ms = best.name, best.ms


def run_workload(world: Any, wl: Workload, *, quick: bool, iters: int, warmup: int, device: str,
                 advance: Callable[[str], None], on_total: Callable[[int], None]) -> tuple[WorkloadResult, list]:
    """Check, time and trace one workload; returns its result and the trace events per rank (of the headline)."""
    start = time.perf_counter()
    ws = world.world_size
    sizes = wl.quick_sizes if quick else wl.sizes
    check_sizes = wl.quick_sizes if quick else wl.check_sizes
    program = wl.program(sizes, device)
    dtype = "/".join(sorted({v.dtype for v in program.tensor_inputs}))
    result = WorkloadResult(wl.key, wl.title, dict(sizes), dict(check_sizes), dtype)
    why = world_applicable(program, ws)
    if why is not None or (wl.key == "pipeline_parallel" and ws < 2):
        result.skipped = why or "the pipeline needs two stages, so at least 2 ranks"
        return result, []
    schedules = enumerate_schedules(program, device)
    on_total(1 + 2 * len(wl.baselines) + len(schedules))
    result.rows = [Row(s.name, s.steps_json(), [n for n in wl.whole if n in lower(s).sliced_state])
                   for s in schedules]
    advance(f"{wl.key}: checking {len(schedules)} schedules on the reference backend")
    small = wl.program(check_sizes, device)
    check_reference(small, [Schedule(small, s.steps) for s in schedules], ws, result.rows)
    tensor_dtype = program.tensor_inputs[0].dtype  # what the baselines compute in
    time_baselines(world, wl, sizes, tensor_dtype, iters, warmup, result, advance)
    events: dict[str, list] = {}
    for s, row in zip(schedules, result.rows):
        advance(f"{wl.key}: {s.name}")
        if not row.reference_ok:
            continue  # a schedule that computes something else is not worth timing
        per_rank = world.run(time_on_rank, s, device, iters, warmup, row.gathers)
        row.build_s = max(r["build_s"] for r in per_rank)
        row.torch_ok = all(r["diff"][1] for r in per_rank)
        row.max_abs = max([row.max_abs] + [r["diff"][0] for r in per_rank])
        if not row.torch_ok:
            row.error = f"torch backend: differs from the program as written by {row.max_abs:.2e}"
            continue
        row.ms = step_time_ms([r["times_ms"] for r in per_rank])
        events[s.name] = [r["events"] for r in per_rank]
    time_baselines(world, wl, sizes, tensor_dtype, iters, warmup, result, advance)
    for row in result.rows:
        row.speedup = result.baseline_ms / row.ms
    result.wall_s = time.perf_counter() - start
    best = result.fastest
    if best is None:
        return result, []
    label = {"schedule": best.schedule}
    return result, [[dict(e, stream=f"{wl.key} {e['stream']}", args={**e["args"], **label}) for e in rank_events]
                    for rank_events in events[best.schedule]]


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
    kernels: str = "auto"  # the route fused stages took (Executable's)
    check_inputs: int = CHECK_INPUTS
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
                      kernels=default_kernels(), total_s=time.perf_counter() - start)
