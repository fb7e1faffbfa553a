"""The shared-memory all-reduce at 2 ranks: three barriers per call (one set of slots) against two barriers with two
sets of slots in turns (shm.all_reduce's default for slots up to ALTERNATE_BYTES), in the same rank processes.

    PYTHONPATH=src flock /tmp/cw-cpu.lock python benchmarks/shm_all_reduce.py [--mib 1] [--rounds 7] [--calls 200]

Both variants do the same work (write the operand, reduce this rank's half, read the other half) and differ only in
the closing barrier. Each round times `--calls` calls of each variant, interleaved; reports the median time per call
in microseconds and the ratio. Writes JSON to benchmarks/results/shm_all_reduce-cpu<cores>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _rank(rank: int, world: int, numel: int, rounds: int, calls: int, path: str, result: str) -> None:
    import torch
    import torch.distributed as dist

    from cocoweave.backends.torch import shm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        g = shm.group_for(None)
        assert g is not None, "the two ranks do not share memory"
        alternating = g.slots("bench", numel, torch.float32)  # shm.Slots: two sets in turns, two barriers
        single = list(g.slots("bench", numel, torch.float32))  # a plain list: one set, three barriers
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        want = sum(torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world))
        out = torch.empty(numel)
        parts = [(0, numel // 2), (numel // 2, numel - numel // 2)]
        times: dict[str, list[float]] = {"three barriers": [], "two barriers, two sets": []}
        for slots in (single, alternating):  # warm (and make the second set)
            for _ in range(10):
                shm.all_reduce(g, slots, x, "sum", parts, out)
        for _ in range(rounds):
            for name, slots in (("three barriers", single), ("two barriers, two sets", alternating)):
                g.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    shm.all_reduce(g, slots, x, "sum", parts, out)
                times[name].append((time.perf_counter() - t0) / calls * 1e6)
                assert torch.equal(out, want), f"{name}: the all-reduce's result is wrong"
        gathered: list = [None] * world
        dist.all_gather_object(gathered, times)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=1.0, help="operand size in MiB (float32)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import machine

    record = machine()
    numel = int(args.mib * (1 << 20)) // 4
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(2, numel, args.rounds, args.calls, f"{d}/store", f"{d}/out.json"), nprocs=2,
                           start_method="spawn")
        per_rank = json.loads(Path(f"{d}/out.json").read_text())
    # the slower rank of each round, then the median over rounds
    table = {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(args.rounds))
             for name in per_rank[0]}
    base = table["three barriers"]
    for name, us in table.items():
        print(f"{name:<26} {us:9.1f} us per call ({us / base:.2f}x)")
    record |= {"load_average_end": os.getloadavg(), "mib": args.mib, "rounds": args.rounds, "calls": args.calls,
               "us_per_call": {k: round(v, 1) for k, v in table.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"shm_all_reduce-cpu{os.cpu_count()}-{record['date'][:10]}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written {path}")


if __name__ == "__main__":
    main()
