"""Time the adasum all-reduce against a sum all-reduce on CPU ranks (Gloo), as a time ratio.

    PYTHONPATH=src python3 benchmarks/adasum.py                       # 4 ranks; 1M, 4M, 16M fp32
    PYTHONPATH=src python3 benchmarks/adasum.py --ranks 4 --sizes 1 4 --iters 10

Per size, on every rank of a LocalWorld: `sum` is torch.distributed.all_reduce; `adasum` is cocoweave's
vector-halving, distance-doubling adasum over P2P (backends/torch/adasum.py); `gather` is the all-gather
of every rank's tensor then the reference's adasum_tree (cocoweave's previous implementation, bandwidth
like an all_gather). Each iteration starts after a barrier; its time is the slowest rank's; the table gives
the median over the iterations and the ratios to `sum`. The first iteration of each method also checks that
adasum and gather agree. Writes JSON to benchmarks/results/adasum-<device>-<date>.json (or $OUT/adasum.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

METHODS = ("sum", "adasum", "gather")


def _gather_adasum(x: torch.Tensor) -> torch.Tensor:
    from cocoweave.backends.adasum import adasum_tree

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return adasum_tree(parts)


def _rank_times(rank: int, world_size: int, numel: int, iters: int, warmup: int) -> dict[str, Any]:
    """This rank's per-iteration times (ms) of each method on a random fp32 tensor of `numel` elements."""
    from cocoweave.backends.torch.adasum import adasum_all_reduce

    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    out = torch.empty_like(x)
    buf = torch.empty_like(x)
    run = {"sum": lambda: dist.all_reduce(buf.copy_(x)), "adasum": lambda: adasum_all_reduce(x, None, out),
           "gather": lambda: _gather_adasum(x)}
    times: dict[str, list[float]] = {}
    for name in METHODS:
        times[name] = []
        for i in range(warmup + iters):
            dist.barrier()
            t0 = time.perf_counter()
            run[name]()
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    err = float((adasum_all_reduce(x, None, out) - _gather_adasum(x)).abs().max())
    return {"times_ms": times, "max_abs_diff_adasum_vs_gather": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16], help="millions of fp32 elements")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from cocoweave.launch import LocalWorld

    rows, load0 = [], os.getloadavg()  # the load of other processes on this machine skews every figure
    print(f"adasum vs sum all_reduce, {args.ranks} ranks, Gloo on CPU, fp32, median of {args.iters} (slowest rank)")
    print(f"{'elements':>10} {'MiB':>6} {'sum ms':>9} {'adasum ms':>10} {'gather ms':>10} {'adasum/sum':>11} "
          f"{'gather/sum':>11}", flush=True)
    with LocalWorld(args.ranks, timeout_s=1800.0) as world:
        for millions in args.sizes:
            numel = int(millions * 2**20)
            per_rank = world.run(_rank_times, numel, args.iters, args.warmup)
            med = {m: statistics.median(max(r["times_ms"][m][i] for r in per_rank) for i in range(args.iters))
                   for m in METHODS}
            rows.append({"numel": numel, "mbytes": numel * 4 / 2**20, "median_ms": med,
                         "adasum_over_sum": med["adasum"] / med["sum"], "gather_over_sum": med["gather"] / med["sum"],
                         "adasum_vs_gather_max_abs_diff": max(r["max_abs_diff_adasum_vs_gather"] for r in per_rank)})
            r, m = rows[-1], med
            print(f"{r['numel']:>10} {r['mbytes']:>6.0f} {m['sum']:>9.1f} {m['adasum']:>10.1f} {m['gather']:>10.1f} "
                  f"{r['adasum_over_sum']:>11.2f} {r['gather_over_sum']:>11.2f}", flush=True)
        threads = world.threads_per_rank
    now = datetime.datetime.now(datetime.UTC)
    device = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    result = {
        "benchmark": "adasum", "rows": rows,
        "env": {"device": device, "ranks": args.ranks, "threads_per_rank": threads, "backend": "gloo",
                "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                "date": now.isoformat(timespec="seconds"), "load_average_at_start": load0,
                "load_average_at_end": os.getloadavg(),
                "command": "PYTHONPATH=src python3 benchmarks/adasum.py " + " ".join(sys.argv[1:])},
    }
    if "OUT" in os.environ:
        path = Path(os.environ["OUT"]) / "adasum.json"
    else:
        path = Path(__file__).parent / "results" / f"adasum-cpu{os.cpu_count()}-{now.date()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
