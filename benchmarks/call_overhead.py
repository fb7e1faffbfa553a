"""Per-call host overhead of a small compiled program: `Executable.run` + `release` of its outputs (what a tensor
parallel layer does many times per step), for two source trees interleaved (e.g. main against a branch).

    PYTHONPATH=src flock /tmp/cw-cpu.lock python benchmarks/call_overhead.py --trees /work/main/src,src

Each round runs, for each tree in turn, a fresh process (PYTHONPATH=<tree>) that times `--calls` calls of the
tensor-parallel layer programs (nn/programs.py: row_forward, column_backward; 8x16x16 float32, torch ops) at 1
rank (the program as written) and at 2 ranks (Gloo: library and shared-memory schedules), and reports per call the
whole call and the `release` part in microseconds. Medians over rounds, and each tree's ratio to the first. Writes
JSON to benchmarks/results/call_overhead-cpu<cores>-<date>.json with the machine, versions, date and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEDULES = ("MM-AR-C", "MM-AR@shm-C", "MM-RS@shm-AG@shm-C", "MM-MM-AR-C", "MM-MM-AR@shm-C")


def _time(rank: int, world: int, calls: int) -> dict[str, list[float]]:
    """{program/schedule: [us per call, us of release per call]} on this rank."""
    import torch

    from cocoweave.backends.torch.executable import Executable
    from cocoweave.nn import programs as P
    from cocoweave.plan import lower
    from cocoweave.schedule.enumerate import enumerate_schedules
    from cocoweave.schedule.schedule import Schedule

    torch.set_num_threads(1)
    out = {}
    for prog in (P.row_forward(8, 16, 16), P.column_backward(8, 16, 16)):
        scheds = [s for s in enumerate_schedules(prog) if s.name in SCHEDULES] if world > 1 else [Schedule(prog)]
        for s in scheds:
            exe = Executable(lower(s), rank, world, kernels="torch")
            ins = {n: torch.randn(*exe.local_shape(n)) for n, v in prog.inputs.items() if not v.is_scalar}
            outs = [n for n, _ in prog.outputs]
            for _ in range(50):  # warm: buffers, shared-memory slots
                res = exe.run(ins).outputs
                [exe.release(res[n]) for n in outs]
            rel = 0.0
            t0 = time.perf_counter()
            for _ in range(calls):
                res = exe.run(ins).outputs
                a = time.perf_counter()
                for n in outs:
                    exe.release(res[n])
                rel += time.perf_counter() - a
            out[f"w{world}/{prog.name}/{s.name}"] = [(time.perf_counter() - t0) / calls * 1e6, rel / calls * 1e6]
    return out


def _rank(rank: int, world: int, calls: int, path: str, result: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        got = _time(rank, world, calls)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(result).write_text(json.dumps(got))


def child(calls: int) -> None:
    """One measurement in this process (1 rank) and two spawned ranks; prints JSON."""
    import torch.multiprocessing as mp

    got = _time(0, 1, calls)
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(2, calls, f"{d}/store", f"{d}/out.json"), nprocs=2, start_method="spawn")
        got |= json.loads(Path(f"{d}/out.json").read_text())
    print(json.dumps(got))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="src", help="comma-separated source folders to compare (the first is 1.0)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    if args.child:
        child(args.calls)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import machine

    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    record = machine()
    runs: dict[str, list[dict[str, list[float]]]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for t in trees:  # interleaved: each round runs every tree once
            env = os.environ | {"PYTHONPATH": t}
            done = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)], env=env,
                                  capture_output=True, text=True, check=True, timeout=600)
            runs[t].append(json.loads(done.stdout.strip().splitlines()[-1]))
    table: dict[str, dict[str, dict[str, float]]] = {}
    for t in trees:
        for case in runs[t][0]:
            call = statistics.median(r[case][0] for r in runs[t])
            rel = statistics.median(r[case][1] for r in runs[t])
            table.setdefault(case, {})[t] = {"call_us": round(call, 2), "release_us": round(rel, 2)}
    print(f"{'case':<48}" + "".join(f"{Path(t).parent.name + ' call/release us':>34}" for t in trees))
    for case, row in table.items():
        base = row[trees[0]]["call_us"]
        cells = [f"{row[t]['call_us']:9.1f} / {row[t]['release_us']:6.2f} ({row[t]['call_us'] / base:4.2f}x)"
                 for t in trees]
        print(f"{case:<48}" + "".join(f"{c:>34}" for c in cells))
    record |= {"load_average_end": os.getloadavg(), "trees": trees, "rounds": args.rounds, "calls": args.calls,
               "cases": table}
    args.out.mkdir(parents=True, exist_ok=True)
    day = record["date"][:10]
    path = args.out / f"call_overhead-cpu{os.cpu_count()}-{day}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written {path}")


if __name__ == "__main__":
    main()
