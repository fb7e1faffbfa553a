"""Heterogeneous ranks (HetSeq, Ding et al. 2021): two ranks, one made about 2x slower, run the data-parallel
Adam program and a training step with equal and with capacity-weighted shares; the goal is weighted <= 0.8x equal.

    PYTHONPATH=src python benchmarks/hetero.py                   # 20 timed steps of each configuration
    PYTHONPATH=src python benchmarks/hetero.py --slowdown 2 --iters 40

The slow rank (a documented artificial load, `Dilation`): rank 1 computes `--slowdown` times slower. Before
each collective, and at the end of the step, it sleeps (slowdown - 1) times what its computation took since the
last one: the computation stages of the generated step (c, C and MM, timed by the executable's trace; the sleep
happens at the entry of the next communication stage, through the stage-entry hook of `cocoweave.faults`) and,
in the training step, its forward and backward pass. So its computation takes twice as long and delays the
collectives that follow it, as on a device half as fast, while its communication runs at the network's speed.
Other load on the machine slows both ranks; run it on a quiet machine (the load average is recorded).

The Adam update runs as one compiled loop (a fused stage), as `DistributedAdamW` runs it on CPU; op by op, its
many 16 MB temporaries made the time depend on each process's allocator state (page faults), up to 2.5x between
two runs of the same rank. Capacity: each rank times the same Adam step on its own; shares are proportional to the
measured speeds (`cocoweave.ir.layout.shares_from_speeds`). Configurations, each equal vs weighted:
- `adam`: the Adam program on N parameters with CoCoNet's schedule, the gradient reduce-scattered into parts in
  proportion to the shares (`Schedule.split(..., shares=...)`), the update on each part, m and v kept sliced
  (`as_slice`), w gathered: the slow rank updates fewer parameters. Collectives through the library (Gloo pads
  uneven parts to the largest), and through shared memory (`@shm`, whose reduce-scatter work follows the part;
  every rank still copies all of w in the all-gather). `adam-sharded`: w kept sliced too (ZeRO-3), no all-gather.
- `train`: a training step: forward and backward of an MLP on the rank's batch (equal: B/2 each; weighted: the
  shares of B, HetSeq's per-rank batch), then the same Adam program averaging the gradients weighted by the batch
  sizes (`all_reduce(g, "avg", weights=...)`), so the result equals one process on the whole batch.

A step's time is the slowest rank's (every step starts after a barrier); the median over steps is reported. Writes
benchmarks/results/hetero-cpu-<date>.json (or $OUT/) with the machine, versions, date, command and every step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from cocoweave import faults, workloads
from cocoweave.ir.layout import share_bounds, shares_from_speeds
from cocoweave.launch import LocalWorld
from cocoweave.schedule.schedule import Schedule

sys.path.insert(0, str(Path(__file__).parent))
from schedules import machine  # noqa: E402 - the benchmarks' one description of the machine

SCALARS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
WIDTH, DEPTH, FEATURES = 512, 3, 256  # the MLP of the training step
SLOW_RANK = 1
# (row name, shared-memory collectives, w kept sliced too) of the Adam program alone
ADAMS = (("adam", False, False), ("adam", True, False), ("adam-sharded", True, True))


COMPUTE = ("c", "C", "MM")  # labels of the computation stages of a generated step


class Dilation:
    """This rank computes `factor` times slower: `add` what computation took, `pay` sleeps the extra time owed."""

    def __init__(self, factor: float):
        self.factor, self.owed = factor, 0.0

    def add(self, seconds: float) -> None:
        self.owed += (self.factor - 1) * seconds

    def add_trace(self, exe: Any) -> None:
        """The computation stages of `exe`'s last step, from its trace spans ("3:C", or a chunk's "C")."""
        events, exe.ctx.events = exe.ctx.events, []
        self.add(sum(t1 - t0 for name, _, t0, t1, _ in events if name.split(":")[-1] in COMPUTE) / 1e9)

    def pay(self) -> None:
        if self.owed > 0:
            time.sleep(self.owed)
        self.owed = 0.0


def _dilation(rank: int, slowdown: float) -> Dilation:
    return Dilation(slowdown if rank == SLOW_RANK else 1.0)


@contextmanager
def before_collectives(slow: Dilation, exe: Any) -> Iterator[None]:
    """Pay what the computation owes at the entry of every communication stage of `exe`'s generated step (the
    runtime calls `faults.enter` at each stage entry while `faults.ACTIVE` is set); restored afterwards."""
    if slow.factor == 1:
        yield
        return
    exe.trace(True)
    old_enter, old_active = faults.enter, faults.ACTIVE

    def enter(rank: int, stage: int, label: str) -> None:
        if label not in COMPUTE:  # RS, AG, RS@shm, ...: the computation before it has finished and been traced
            slow.add_trace(exe)
            slow.pay()
        old_enter(rank, stage, label)

    faults.enter, faults.ACTIVE = enter, True
    try:
        yield
    finally:
        faults.enter, faults.ACTIVE = old_enter, old_active


def _slow_step(exe: Any, slow: Dilation, inputs: dict[str, Any]) -> None:
    """One step of `exe`, its computation dilated (inside `before_collectives`)."""
    exe.run(inputs)
    slow.add_trace(exe)
    slow.pay()


def adam_schedule(n: int, shares: tuple[int, ...] | None, shm: bool, weights: tuple[int, ...] | None = None,
                  sharded: bool = False) -> Schedule:
    """Adam on n parameters: RS (in proportion to `shares`), the update on the part, m and v kept sliced, AG of
    w; `sharded`: w kept sliced too (ZeRO-3: gathered where a forward pass needs it), no AG in the step."""
    s = Schedule(workloads.adam(n, weights=weights))
    _, ag = s.split(s.find("all_reduce")[0], 0, shares=shares)
    s.reorder(ag)
    s.as_slice("m", "v", *(("w",) if sharded else ()))
    for stage in [x for x in s.stages if x.kind == "compute"]:
        s.fuse(stage)  # the update as one compiled loop, as DistributedAdamW runs it on CPU
    if shm:
        for stage in s.stages:
            if stage.kind == "collective":
                s.algorithm(stage, "shm")
    return s


def _state(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n, generator=g), "m": torch.zeros(n), "v": torch.zeros(n)}


def profile(rank: int, world_size: int, n: int, repeats: int, slowdown: float) -> float:
    """Seconds this rank takes for one Adam step on n parameters, alone (median of `repeats`; the ranks take
    turns, round after round)."""
    import torch.distributed as dist

    from cocoweave.backends.torch import Executable
    from cocoweave.plan import lower

    s = Schedule(workloads.adam(n, grad="reduced"))
    for stage in [x for x in s.stages if x.kind == "compute"]:
        s.fuse(stage)  # one loop, no temporaries: op by op, a process's allocator state (page faults) decided the time
    exe = Executable(lower(s), 0, 1, {}, "cpu")
    inputs = {"g": torch.randn(n), **_state(n), **SCALARS, "step": 1.0}
    exe.run(inputs)  # warm-up
    slow = _dilation(rank, slowdown)
    times = []
    with before_collectives(slow, exe):
        for _ in range(repeats):  # rounds of turns, one rank at a time (the others wait, so no two share cores);
            for turn in range(world_size):  # interleaved, so that a passing load weighs on every rank alike
                if turn == rank:
                    t0 = time.perf_counter()
                    _slow_step(exe, slow, inputs)
                    times.append(time.perf_counter() - t0)
                dist.barrier()
    return statistics.median(times)


def time_adam(rank: int, world_size: int, schedule: Schedule, n: int, iters: int, slowdown: float) -> list[float]:
    """Milliseconds of each timed step of the Adam schedule on this rank."""
    from cocoweave.backends.torch import Executable
    from cocoweave.backends.torch.worker import timed_steps
    from cocoweave.plan import lower

    exe = Executable(lower(schedule), rank, world_size, {}, "cpu")
    g = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    given = {"g": g, **_state(n), **SCALARS, "step": 1.0}
    exe.run(given)
    inputs = {"g": g, **SCALARS, "step": 2.0}  # m and v (and w when sliced) stay in the executable
    if "w" not in schedule.sliced_state:
        inputs["w"] = given["w"]
    slow = _dilation(rank, slowdown)
    with before_collectives(slow, exe):
        return timed_steps(lambda: _slow_step(exe, slow, inputs), world_size, torch.device("cpu"), iters, 3)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    width = FEATURES
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(width, WIDTH), torch.nn.ReLU()]
        width = WIDTH
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def time_train(rank: int, world_size: int, batches: tuple[int, ...], shares: tuple[int, ...] | None, shm: bool,
               iters: int, slowdown: float) -> dict[str, Any]:
    """A training step of the MLP on this rank's batch, then Adam through the cocoweave program with the gradient
    average weighted by the batch sizes; parameters and gradients are views of the program's flat w and g."""
    from cocoweave.backends.torch import Executable
    from cocoweave.backends.torch.worker import timed_steps
    from cocoweave.plan import lower

    model = _mlp()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    w, g = torch.empty(n), torch.zeros(n)
    offset = 0
    for p in params:  # parameters and gradients as views of one flat bucket each (like DDP's buckets)
        w[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = w[offset:offset + p.numel()].view_as(p)
        p.grad = g[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    weights = batches if len(set(batches)) > 1 else None
    exe = Executable(lower(adam_schedule(n, shares, shm, weights)), rank, world_size, {}, "cpu")
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batches[rank], FEATURES, generator=gen), torch.randn(batches[rank], 1, generator=gen)
    state = {"m": torch.zeros(n), "v": torch.zeros(n)}
    count = [0]
    slow = _dilation(rank, slowdown)

    def step() -> None:
        t0 = time.perf_counter()
        g.zero_()
        torch.nn.functional.mse_loss(model(x), y).backward()
        slow.add(time.perf_counter() - t0)
        slow.pay()  # the forward and backward, slowed, before the gradient's reduce-scatter
        count[0] += 1
        _slow_step(exe, slow, {"g": g, "w": w, **SCALARS, "step": float(count[0]), **state})
        state.clear()  # given once; the executable keeps its part of m and v

    with before_collectives(slow, exe):
        times = timed_steps(step, world_size, torch.device("cpu"), iters, 3)
    return {"times_ms": times, "parameters": n, "batch": batches[rank]}


def _step_ms(per_rank: list[list[float]]) -> tuple[float, list[float]]:
    steps = [max(s) for s in zip(*per_rank)]
    return statistics.median(steps), steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slowdown", type=float, default=2.0, help="how many times slower rank 1 computes")
    ap.add_argument("--n", type=int, default=1 << 22, help="parameters of the Adam program")
    ap.add_argument("--batch", type=int, default=512, help="global batch of the training step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.slowdown < 1:
        ap.error("--slowdown must be at least 1")
    console = Console(width=max(120, Console().width))
    info = machine("cpu", 2)
    started = dt.datetime.now(dt.UTC)
    results: list[dict[str, Any]] = []
    with LocalWorld(2, timeout_s=args.timeout) as world:
        info["threads_per_rank"] = world.threads_per_rank
        seconds = world.run(profile, args.n, 7, args.slowdown)
        shares = shares_from_speeds([1 / s for s in seconds])
        console.print(f"measured Adam step alone: {[f'{s * 1e3:.1f} ms' for s in seconds]} -> shares {shares}",
                      highlight=False)
        for workload, shm, sharded in ADAMS:
            for label, sh in (("equal", None), ("weighted", shares)):
                per_rank = world.run(time_adam, adam_schedule(args.n, sh, shm, sharded=sharded), args.n, args.iters,
                                     args.slowdown)
                median, steps = _step_ms(per_rank)
                results.append({"workload": workload, "algorithm": "shm" if shm else "library", "shares": label,
                                "split": sh, "parts": [share_bounds(args.n, sh or 2, r) for r in range(2)],
                                "median_ms": median, "steps_ms": steps})
                console.print(f"  {workload:<12} {results[-1]['algorithm']:<7} {label:<8} {median:8.2f} ms",
                              highlight=False)
        for label, sh in (("equal", None), ("weighted", shares)):
            batches = tuple(b - a for a, b in (share_bounds(args.batch, sh or 2, r) for r in range(2)))
            per_rank = world.run(time_train, batches, sh, True, args.iters, args.slowdown)
            median, steps = _step_ms([r["times_ms"] for r in per_rank])
            results.append({"workload": "train", "algorithm": "shm", "shares": label, "split": sh, "batches": batches,
                            "parameters": per_rank[0]["parameters"], "median_ms": median, "steps_ms": steps})
            console.print(f"  train   {label:<8} batches {batches} {median:8.2f} ms", highlight=False)
    if hasattr(os, "getloadavg"):
        info["load_average_at_end"] = os.getloadavg()
    t = Table(title=f"measured: step time with rank 1 computing {args.slowdown:g}x slower, median of {args.iters} "
                    f"steps (max over 2 ranks), {info['cpu']}", title_justify="left")
    for col in ("workload", "collectives", "equal ms", "weighted ms", "weighted / equal", "goal <= 0.8"):
        t.add_column(col, justify="left" if col in ("workload", "collectives") else "right")
    for workload, algorithm in [(w, "shm" if shm else "library") for w, shm, _ in ADAMS] + [("train", "shm")]:
        eq, wt = (next(r for r in results if (r["workload"], r["algorithm"], r["shares"]) == (workload, algorithm, k))
                  for k in ("equal", "weighted"))
        ratio = wt["median_ms"] / eq["median_ms"]
        t.add_row(workload, algorithm, f"{eq['median_ms']:.2f}", f"{wt['median_ms']:.2f}", f"{ratio:.2f}",
                  "met" if ratio <= 0.8 else "missed")
    console.print(t)
    doc = {"benchmark": "hetero", "date": started.isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": info,
           "slow_rank": SLOW_RANK, "slowdown": args.slowdown, "profile_s": seconds, "shares": shares,
           "n": args.n, "batch": args.batch, "iters": args.iters,
           "method": "rank 1 sleeps (slowdown - 1) x its computation time (traced c/C/MM stages, forward and backward) "
                     "at the end of each step; every step after a barrier; a step's time is the slower rank's; median "
                     "over steps (all numbers measured)",
           "rows": results}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"hetero-cpu-{started:%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    console.print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
