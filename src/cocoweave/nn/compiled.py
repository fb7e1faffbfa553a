"""How a tensor-parallel layer runs its programs (nn/programs.py): the schedule it asked for resolved per program
(a name, "auto", or the program as written), one executable per program and shape, compiled on first use.

    schedule=None or "as written"   the hand-written autograd path (torch ops, library collectives)
    schedule="<name>"               that schedule of the program that has it (e.g. "MM-RS@shm-C-AG@shm" for a
                                    row-parallel forward); the layer's other programs take the same collective
                                    algorithm ("@shm" or the library's) with their computation fused
    schedule="auto"                 the tuner's cached choice (`cocoweave tune`), else measured here on the
                                    layer's first inputs: every candidate timed on every rank (the slowest rank
                                    counts), the fastest kept for every layer of that shape

`ASYNC` is Megatron's asynchronous input-gradient all-reduce as a column-parallel backward schedule: the
reduction is launched (library algorithm, asynchronously: a CUDA stream on GPUs, Gloo's thread on CPUs) and the
weight-gradient matmul runs while it is in flight. `ASYNC_SHM` is the same on shared memory (ranks of one host, on
CPUs), with no thread: the input gradient is computed into this rank's slot and flagged, the weight gradient is
computed, and only then are the slots summed (group_facts.PostedAllReduce), so a rank that reaches the reduction
first computes instead of waiting for the others (one core per rank: nothing to overlap on, but the ranks' skew is
absorbed).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import collectives, settings
from ..compiler import compile as compile_schedule
from ..errors import ParallelConfigError
from ..group_facts import Posted, PostedAllReduce, shared_memory
from ..ir.graph import Program
from ..ir.layout import slice_bounds
from ..schedule.enumerate import schedules_of
from ..schedule.schedule import Schedule
from ..tune import Context, Measure, choose
from .functional import Group
from .programs import ASYNC, ASYNC_SHM

AS_WRITTEN = "as written"
AUTO_ROUNDS = 7  # interleaved timed rounds (one run of every candidate each) when "auto" measures
# A later (less simple) candidate must be this much faster, measured alone, to be chosen: alone, a schedule with more
# barriers looks faster than it is inside a step where every rank is busy (tp_step at d512: the split MM-RS-C-AG
# chosen alone by 3% ran the step no faster than MM-AR@shm-C).
AUTO_MARGIN = 0.10

_FINGERPRINTS: dict[int, tuple[Program, str]] = {}


def _fingerprint(program: Program) -> str:
    """program.fingerprint() (a hash of its printed form) once per program object: the layers' programs are finished,
    cached objects, and every forward and backward looks its executable up by it."""
    hit = _FINGERPRINTS.get(id(program))
    if hit is None or hit[0] is not program:
        hit = _FINGERPRINTS[id(program)] = (program, program.fingerprint())
    return hit[1]


def check_schedule(schedule: str | None, who: str) -> str | None:
    """The schedule a layer was given, None for the hand-written path (None or "as written")."""
    if schedule is None or schedule == AS_WRITTEN:
        return None
    if not isinstance(schedule, str) or not schedule:
        raise ParallelConfigError(f"{who}: schedule must be None, 'as written', 'auto' or a schedule's name, "
                                  f"got {schedule!r}")
    return schedule


def schedules(program: Program) -> list[Schedule]:
    """Every schedule of `program` (enumerate_schedules, memoised)."""
    return schedules_of(program)


def _fused(s: Schedule) -> bool:
    """Every computation one compiled loop, on no algorithm the collectives table never picks automatically (the
    ring: slow on CPU and GPU alike for these sizes)."""
    return not any(collectives.get(a).auto == "never" for a in collectives.uses(s.stages)) and \
        not any(st.kind == "compute" and not st.fused for st in s.stages)


def _on_host(algorithms: frozenset[str]) -> bool:
    """Whether any of `algorithms` needs the ranks to share a host (shared memory), by the collectives table."""
    return any(collectives.get(a).one_host for a in algorithms)


def candidates(program: Program, shared_host: bool) -> list[Schedule]:
    """What "auto" measures, in order of preference: the fused schedules on shared memory where the group shares
    this host, then on the library's collectives (the program as written among them)."""
    fused = [s for s in schedules(program) if _fused(s) and (shared_host or not _on_host(collectives.uses(s.stages)))]
    # shared memory first where it applies, then the simplest: one collective before a split one before a fused one
    return sorted(fused, key=lambda s: (not _on_host(collectives.uses(s.stages)), "fuse(" in s.name,
                                        s.name.count("-"))) or \
        schedules(program)[:1]


def _family(program: Program) -> str:
    """Which layers a program belongs to: "moe" (the MoE layer's experts) or "tp" (the tensor-parallel layers)."""
    return "moe" if program.name.startswith("moe") else "tp"


def named(program: Program, name: str, shared_host: bool) -> Schedule:
    """Schedule `name` of `program`, or, for a name another program of the same layers has, this program's fused
    schedule on the same collective algorithm."""
    every = schedules(program)
    for s in every:
        if s.name == name:
            return s
    family = _family(program)
    known = _layer_schedules(family)
    if name not in known:
        who = "the MoE layer's experts" if family == "moe" else "the tensor-parallel layers"
        raise ParallelConfigError(f"schedule {name!r} is not available for {who}; choose one of: auto, "
                                  f"{AS_WRITTEN!r}, {', '.join(sorted(known))}")
    fused = [s for s in every if _fused(s)]
    want_host = shared_host and _on_host(known.get(name, frozenset()))
    same = [s for s in fused if _on_host(collectives.uses(s.stages)) == want_host and "fuse(" not in s.name]
    return (same or fused or every)[0]


@functools.lru_cache(maxsize=2)
def _layer_schedules(family: str = "tp") -> dict[str, frozenset[str]]:
    """The name of every schedule of one family's programs (at any size the same names), with the collective
    algorithms it runs on (other than the default): "tp", the tensor-parallel layers', or "moe", the MoE layer's
    experts'."""
    from . import programs as P

    if family == "moe":
        tiny = [P.moe_forward(1, 1, 4, 4, 4, 4), P.moe_backward(1, 1, 4, 4, 4, 4)]
        return {s.name: collectives.uses(s.stages) for p in tiny for s in schedules(p)}
    tiny = [P.row_forward(4, 4, 4, drop=0.1, sp=sp) for sp in (False, True)]
    tiny += [P.row_backward(4, 4, 4, drop=0.1, sp=sp) for sp in (False, True)]
    tiny += [P.column_backward(4, 4, 4, sp=sp) for sp in (False, True)] + [P.column_forward_sp(4, 4, 4)]
    every = {s.name: collectives.uses(s.stages) for p in tiny for s in schedules(p)}
    return {**every, ASYNC: frozenset(), ASYNC_SHM: frozenset({"shm"})}  # the column backward's routes


class Programs:
    """One layer's compiled programs: executables by (program fingerprint, schedule), the schedule each program
    runs (for print(model)), and "auto"'s measurement."""

    def __init__(self, schedule: str, group: Group, size: int, rank: int) -> None:
        self.schedule, self.group, self.size, self.rank = schedule, group, size, rank
        self.chosen: dict[str, str] = {}  # program kind ("forward", "backward") -> the schedule it runs
        self._exes: dict[tuple, Any] = {}
        # what a program resolved to, so that every later call (each forward and backward) goes straight to it:
        # by (what, kind, id(program), device) -> (program, value); see `_once`
        self._resolved: dict[tuple, tuple[Program, Any]] = {}
        self._posted = PostedAllReduce(group)  # ASYNC_SHM's slots

    def posted_all_reduce(self, out: torch.Tensor) -> Posted | None:
        """An all-reduce (sum) into `out` over the layer's group split in two on shared memory (ASYNC_SHM), or None
        where the group's ranks do not share this host's memory or its slots cannot alternate (the same on every
        rank): the caller then takes the blocking route."""
        return self._posted.open(out)

    def _once(self, what: str, kind: str, program: Program, device: torch.device, make: Callable[[], Any]) -> Any:
        """`make()` the first time `program` asks for `what`, the remembered value after (ids are reused once a
        program is gone, so the entry keeps its program and is checked by identity)."""
        key = (what, kind, id(program), device)
        hit = self._resolved.get(key)
        if hit is None or hit[0] is not program:
            hit = self._resolved[key] = (program, make())
        return hit[1]

    def part_rows(self, rows: int) -> int:
        """How many of `rows` tokens this rank holds under sequence parallelism (torch.tensor_split sizes)."""
        start, stop = slice_bounds(rows, self.size, self.rank)
        return stop - start

    def describe(self) -> str:
        if not self.chosen:
            return f"{self.schedule} (resolved on the first call)"
        return ", ".join(f"{k}: {v}" for k, v in self.chosen.items())

    def run(self, kind: str, program: Program, inputs: Mapping[str, Any], device: torch.device,
            outputs: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """Run `program` (this layer's `kind` program) on `inputs`; the named outputs, owned by the caller."""
        exe, self.chosen[kind] = self._once(
            "run", kind, program, device, lambda: (self._executable(kind, program, inputs, device), self.chosen[kind]))
        res = exe.run(inputs).outputs
        return tuple(exe.release(res[n]) for n in outputs)

    def launch(self, kind: str, program: Program, inputs: Mapping[str, Any], device: torch.device) -> Any:
        """Issue `program`'s opening collective asynchronously (library algorithm); returns its executable, whose
        `run(inputs)` later completes it."""
        exe = self._once("launch", kind, program, device,  # the route's name stays in `chosen`
                         lambda: self._compiled(kind, program, _library(program), device, record=False))
        exe.launch(inputs)
        return exe

    def _executable(self, kind: str, program: Program, inputs: Mapping[str, Any], device: torch.device) -> Any:
        shared = shared_memory(self.group, device) is not None
        name = self.schedule
        if name == "auto":
            s = self._auto(kind, program, inputs, device, shared)
        else:
            s = named(program, name, shared)
        return self._compiled(kind, program, s, device)

    def _compiled(self, kind: str, program: Program, s: Schedule, device: torch.device, record: bool = True) -> Any:
        if record:
            self.chosen[kind] = s.name
        key = (_fingerprint(program), s.name, device)
        exe = self._exes.get(key)
        if exe is None:
            exe = self._exes[key] = compile_schedule(s, "torch", device=device, rank=self.rank, world_size=self.size,
                                                     group=self.group, kernels=kernels(program, device))
        return exe

    def _auto(self, kind: str, program: Program, inputs: Mapping[str, Any], device: torch.device,
              shared: bool) -> Schedule:
        """"auto" (tune.choose, kept for the process per program and place): the tuner's cached choice, else the
        fastest candidate measured here (or in an earlier run)."""
        size = self.size

        def measured() -> Schedule | Measure[Schedule]:
            options = candidates(program, shared)
            if len(options) == 1:
                return options[0]
            names = [o.name for o in options]
            key = (f"nn-auto|{_fingerprint(program)}|w{size}|{device.type}|{'shm' if shared else 'library'}|"
                   + ",".join(names))
            return Measure(key, options, names, lambda: self._measure(kind, program, options, inputs, device),
                           self._agreed)

        return choose(program, Context(size, device.type, tuned=size > 1, keep=("schedule", shared)), measured)

    def _agreed(self, index: int) -> int | None:
        """`index` (a remembered choice, -1 for none) when every rank of the group remembers the same, else None:
        then every rank measures, together (ranks on other hosts may have other caches)."""
        if self.size == 1:
            return index if index >= 0 else None
        t = torch.tensor([index, -index], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]) if int(t[0]) == -int(t[1]) and index >= 0 else None

    def _measure(self, kind: str, program: Program, options: list[Schedule], inputs: Mapping[str, Any],
                 device: torch.device) -> int:
        """The index of the fastest candidate on these inputs (`fastest`)."""
        exes = [self._compiled(kind, program, s, device) for s in options]
        best = self.fastest([lambda exe=exe: exe.run(inputs) for exe in exes], device)
        for s in options:  # the others' buffers (and shared-memory slots) go
            if s is not options[best]:
                self._exes.pop((_fingerprint(program), s.name, device), None)
        return best

    def fastest(self, runs: list[Callable[[], Any]], device: torch.device) -> int:
        """Index of the fastest of `runs` (each computing the same thing), timed interleaved: one warm-up each, then
        AUTO_ROUNDS rounds, median; the slowest rank's time counts (one all-reduce of the times, so every rank picks
        the same). A later (less simple) one is chosen only when it is AUTO_MARGIN faster."""
        for run in runs:
            run()
        times: list[list[float]] = [[] for _ in runs]
        for _ in range(AUTO_ROUNDS):
            for run, r in zip(runs, times, strict=True):
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                r.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(r) for r in times], dtype=torch.float64)
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        best = 0
        for i in range(1, len(runs)):
            if t[i] < t[best] * (1 - AUTO_MARGIN):
                best = i
        return best

    def route(self, kind: str, program: Program, routes: dict[str, Callable[[], Any]], device: torch.device) -> str:
        """Which of several whole routes of `kind` to take (e.g. a backward program, or ASYNC): the one named by
        the layer's schedule, else for "auto" the fastest (`fastest`, once per program and group size)."""
        name = self._once("route", kind, program, device, lambda: self._route(program, routes, device))
        if name in (ASYNC, ASYNC_SHM):
            self.chosen[kind] = name
        return name

    def _route(self, program: Program, routes: dict[str, Callable[[], Any]], device: torch.device) -> str:
        if self.schedule in routes:
            return self.schedule
        first = next(iter(routes))  # the program as written
        if self.schedule != "auto" or self.size == 1:
            return first
        names = list(routes)
        if shared_memory(self.group, device) is not None:
            # ASYNC's reduction runs on Gloo's thread, which on one host takes the core the weight-gradient matmul
            # needs (one core per rank): alone it measured faster (the other rank's core idle), in the step slower
            # (tp_step d512: 468 ms against 410 for MM-AR@shm-C). It is a choice where the wait is the network's.
            # ASYNC_SHM comes first, so the program as written must be AUTO_MARGIN faster alone to be kept: alone the
            # two do the same work; in a step ASYNC_SHM absorbs the ranks' skew (tp_step d512: -1% to -2%, docs/perf.md,
            # "Tensor-parallel training step")
            names = [ASYNC_SHM, first] if ASYNC_SHM in routes else [first]
        if len(names) == 1:
            return names[0]
        key = f"nn-route|{_fingerprint(program)}|w{self.size}|{device.type}|" + ",".join(names)
        measure = Measure(key, names, names, lambda: self.fastest([routes[n] for n in names], device), self._agreed)
        return choose(program, Context(self.size, device.type, tuned=False, keep=("route", tuple(names))),
                      lambda: measure)


def kernels(program: Program, device: torch.device) -> str | None:
    """How a layer program's fused stages run: on CPU without dropout op by op ("torch"), else (and whenever
    $COCOWEAVE_KERNELS chooses) the executable's default (compiled: one loop per stage; on CUDA Triton). A layer's
    stage without dropout is a bias-gradient sum or a bias + residual add, which torch runs in one or two ops; a
    compiled call costs more than it saves (d256, 1024 x 256: the sum 0.125 ms compiled, 0.034 ms as one op; bias +
    residual 0.29 ms against 0.25). A dropout stage's counter hash is a dozen int64 ops op by op, 15x slower than
    its compiled loop (12.5 ms against 0.81)."""
    if device.type != "cpu" or settings.KERNELS.text() is not None or any(v.op == "dropout" for v in program.values):
        return None
    return "torch"


def _library(program: Program) -> Schedule:
    """The program as written with its computation fused, on the library's collectives (what `launch` issues)."""
    return next((s for s in schedules(program) if _fused(s) and not collectives.uses(s.stages)), schedules(program)[0])

