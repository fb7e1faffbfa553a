"""Time one training step of cocoweave.optim.DistributedAdamW against DDP + torch.optim.AdamW and
DDP + torch's ZeroRedundancyOptimizer, in the same run, on a LocalWorld of Gloo CPU ranks.

    PYTHONPATH=src python3 benchmarks/optim.py --world 2 --hidden 1024 --steps 10

Every variant trains the same MLP on the same data; the table gives the median step time
(forward + backward + reduction + update) and its ratio to DDP + AdamW. JSON goes to
benchmarks/results/optim-cpu<cores>-<date>.json with the machine, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, hidden))


def bench(rank: int, world_size: int, variant: str, hidden: int, steps: int) -> list[float]:
    """Median-able step times (s) of one variant on this rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cocoweave.optim import DistributedAdamW

    model = _model(hidden)
    if variant.startswith("cocoweave"):
        schedule = variant.split(":", 1)[1]
        opt = DistributedAdamW(model.parameters(), lr=1e-4, schedule=schedule)
        run = model
    else:
        run = DDP(model)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-4) if variant == "ddp+adamw" else
               ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4))
    x = torch.randn(32, hidden, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        run(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    from cocoweave.launch import LocalWorld

    variants = ["ddp+adamw", "ddp+zero", "cocoweave:AR-C", "cocoweave:auto"]
    rows = []
    with LocalWorld(args.world, timeout_s=600) as world:
        for v in variants:
            per_rank = world.run(bench, v, args.hidden, args.steps)
            step = statistics.median(max(ts) for ts in zip(*per_rank, strict=True))  # the slowest rank sets the pace
            rows.append({"variant": v, "median_step_s": step})
    base = rows[0]["median_step_s"]
    params = sum(p.numel() for p in _model(args.hidden).parameters())
    print(f"AdamW step, {params / 1e6:.1f}M parameters, {args.world} Gloo CPU ranks, {os.cpu_count()} cores")
    print(f"{'variant':<20} {'median step (ms)':>17} {'vs DDP+AdamW':>13}")
    for r in rows:
        r["ratio_to_ddp_adamw"] = r["median_step_s"] / base
        print(f"{r['variant']:<20} {1e3 * r['median_step_s']:>17.1f} {r['ratio_to_ddp_adamw']:>13.2f}")
    out = Path(__file__).parent / "results" / f"optim-cpu{os.cpu_count()}-{datetime.date.today()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"benchmark": "optim", "world_size": args.world, "hidden": args.hidden,
                               "parameters": params, "steps": args.steps, "rows": rows,
                               "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                               "torch": torch.__version__, "python": platform.python_version(),
                               "date": datetime.datetime.now(datetime.UTC).isoformat()}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
