"""Every schedule of every example on the torch backend: median step time (max over ranks) against the
program as written, at one world size, on the CPU (Gloo) or a GPU (Gloo with CUDA tensors on one GPU,
NCCL with one GPU per rank).

    PYTHONPATH=src python benchmarks/schedules.py                     # CPU, 4 ranks, 20 timed steps
    PYTHONPATH=src python benchmarks/schedules.py --device cuda       # when a GPU is lent

Prints a table and writes benchmarks/results/schedules-<device>-<date>.json (or $OUT/ when set) with the
machine, the versions, the date, the command and every step time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.worker import time_schedule
from cocoweave.ir.loader import load_example
from cocoweave.launch import LocalWorld
from cocoweave.schedule.enumerate import enumerate_schedules

# Sizes: a 512K-parameter optimizer step (2 MB per fp32 tensor) and a Megatron block of 512 tokens x 512
# features in fp16 (CoCoNet's shapes scaled down so that 4 ranks on 2 cores finish in minutes); GPUs get
# CoCoNet-like ones.
SIZES = {
    "cpu": [("adam.py:adam", {"N": 1 << 19}), ("lamb.py:lamb", {"N": 1 << 19}),
            ("model_parallel.py:layer", {"B": 4, "S": 128, "H": 512}),
            ("pipeline_parallel.py:boundary", {"B": 4, "S": 128, "H": 512})],
    "cuda": [("adam.py:adam", {"N": 1 << 26}), ("lamb.py:lamb", {"N": 1 << 26}),
             ("model_parallel.py:layer", {"B": 8, "S": 1024, "H": 4096}),
             ("pipeline_parallel.py:boundary", {"B": 8, "S": 1024, "H": 4096})],
}


def machine(device: str, world_size: int) -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"device": device, "cpu": cpu, "cores": cores, "host": socket.gethostname(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    if device == "cpu" and cores and world_size > cores:
        info["note"] = (f"{world_size} ranks on {cores} cores: oversubscribed (each rank gets one thread and "
                        "they share the cores), so communication and computation compete for the same cores")
    return info


def bench_example(world: LocalWorld, spec: str, sizes: dict[str, int], device: str, iters: int,
                  console: Console) -> list[dict[str, Any]]:
    """Time every schedule of one example; the first (the program as written) is the baseline."""
    program = load_example(spec, **sizes)
    schedules = enumerate_schedules(program, device)  # no @shm off the CPU
    inputs = make_inputs(program, world.world_size, {}, seed=0)
    rows = []
    for s in schedules:
        start = time.perf_counter()
        per_rank = world.call(time_schedule, (s, inputs, {}, device, iters))
        steps = [max(ts) for ts in zip(*(r["times_ms"] for r in per_rank))]  # a step ends when every rank did
        rows.append({"example": spec, "program": program.name, "sizes": sizes, "schedule": s.name,
                     "fingerprint": s.fingerprint(), "median_ms": statistics.median(steps),
                     "min_ms": min(steps), "max_ms": max(steps), "steps_ms": steps,
                     "rank_median_ms": [statistics.median(r["times_ms"]) for r in per_rank],
                     "wall_s": time.perf_counter() - start})
        console.print(f"  {program.name:<16} {s.name:<34} {rows[-1]['median_ms']:9.2f} ms", highlight=False)
    base = rows[0]["median_ms"]
    for r in rows:
        r["ratio_to_baseline"] = r["median_ms"] / base
    return rows


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("program", "schedule", "median ms", "min ms", "vs as written"):
        t.add_column(col, justify="right" if col not in ("program", "schedule") else "left")
    best: dict[str, float] = {}
    for r in rows:
        best[r["program"]] = min(best.get(r["program"], float("inf")), r["median_ms"])
    for r in rows:
        star = r["median_ms"] == best[r["program"]]
        ratio = f"{r['ratio_to_baseline']:.2f}x"
        t.add_row(r["program"], r["schedule"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}",
                  f"[bold green]{ratio}[/]" if star else ratio)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20, help="timed steps per schedule (after 3 warm-up steps)")
    ap.add_argument("--only", default=None, help="only the examples whose spec contains this text")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.iters < 20:
        ap.error("--iters must be at least 20 (medians of fewer steps are noise on a shared machine)")
    console = Console(width=max(120, Console().width))
    info = machine(args.device, args.world_size)
    started = dt.datetime.now(dt.UTC)
    rows: list[dict[str, Any]] = []
    with LocalWorld(args.world_size, backend="auto", device=args.device, timeout_s=args.timeout) as world:
        info["backend"] = world.backend
        info["threads_per_rank"] = world.threads_per_rank
        for spec, sizes in SIZES[args.device]:
            if args.only and args.only not in spec:
                continue
            rows += bench_example(world, spec, sizes, args.device, args.iters, console)
    elapsed = (dt.datetime.now(dt.UTC) - started).total_seconds()
    if hasattr(os, "getloadavg"):  # other jobs on the machine make the figures noisy: say how busy it was
        info["load_average_at_end"] = os.getloadavg()
    where = info.get("gpu", info["cpu"])
    console.print(table(rows, f"Step time, median of {args.iters} steps (max over {args.world_size} ranks), "
                              f"{info['backend']} on {args.device}: {where}"))
    if "note" in info:
        console.print(f"[yellow]note:[/] {info['note']}", highlight=False)
    doc = {"benchmark": "schedules", "date": started.isoformat(timespec="seconds"), "elapsed_s": elapsed,
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "world_size": args.world_size,
           "iters": args.iters, "warmup": 3, "machine": info,
           "method": "each step starts after a barrier; a step's time is the slowest rank's; median over the "
                     "steps; ratio = median / median of the program as written (the first schedule)",
           "rows": rows}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"schedules-{args.device}-{started:%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    console.print(f"results written to {path} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
