"""Host work of a data-parallel training step per parameter tensor: models of 50, 300 and 1000 tiny parameters (so
kernels are negligible and what is left is Python and dispatch), zero_grad, forward + backward (the gradient hooks
and their collectives) and the optimizer step timed separately, for DDP + AdamW(fused) (with and without
`gradient_as_bucket_view`), FSDP2 + AdamW(fused), ZeroRedundancyOptimizer(AdamW fused) and cocoweave's
DistributedAdamW with its defaults, in the same rank processes, interleaved and repeated, on a LocalWorld of Gloo CPU
ranks. Beside the times, per step: Python function calls (cProfile) and leaf aten ops (torch.profiler: on a GPU each
would be a kernel launch or a host-side op).

    .venv/bin/python benchmarks/host_overhead.py                         # 50, 300, 1000 parameters; 1 and 2 ranks
    .venv/bin/python benchmarks/host_overhead.py --params 1000 --worlds 2
    .venv/bin/python benchmarks/host_overhead.py --quick

The model: `--params / 2` blocks of Linear(4, 4) (weight and bias), each applied to a 2 x 4 input in turn with a tanh
between; loss = the output's mean square. Phase times are medians over steps of the slowest rank's (a barrier before
each step). JSON goes to benchmarks/results/host_overhead-<options>-cpu<cores>-<date>.json with the machine,
versions, date and load average.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import machine, results_path  # noqa: E402  the house's machine record and results path

ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
VARIANTS = ("ddp-fused", "ddp-fused-bucket-view", "fsdp2-fused", "zero-fused", "cocoweave")
PHASES = ("zero_grad", "forward_backward", "step")


class Tiny(nn.Module):
    """`blocks` Linear(4, 4) applied in turn: 2 x blocks parameter tensors of 16 and 4 elements."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def build(variant: str, params: int) -> tuple[nn.Module, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cocoweave.optim import DistributedAdamW

    model = Tiny(params // 2)
    if variant == "cocoweave":
        return model, DistributedAdamW(model.parameters(), **ADAMW)
    if variant == "fsdp2-fused":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)  # one group for the whole model: per-layer groups would add FSDP2's own per-module work
        return model, torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    ddp = DDP(model, gradient_as_bucket_view=variant == "ddp-fused-bucket-view")
    if variant == "zero-fused":
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW,
                                            fused=True)
    return ddp, torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)


def phases(run: nn.Module, opt: Any, x: torch.Tensor) -> tuple[float, float, float]:
    """Milliseconds of zero_grad, forward + backward, step."""
    t0 = time.perf_counter()
    opt.zero_grad()
    t1 = time.perf_counter()
    run(x).square().mean().backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)


def counts(run: nn.Module, opt: Any, x: torch.Tensor) -> dict[str, int]:
    """Python function calls and leaf aten ops of one step."""
    prof = cProfile.Profile()
    prof.enable()
    phases(run, opt, x)
    prof.disable()
    calls = sum(entry.callcount for entry in prof.getstats())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        phases(run, opt, x)
    leaves = 0
    for e in tp.events():
        if e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children):
            leaves += 1
    return {"python_calls": calls, "leaf_aten_ops": leaves}


def timings(rank: int, world_size: int, params: int, names: list[str], rounds: int, steps: int) -> dict[str, Any]:
    built = {v: build(v, params) for v in names}
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[tuple[float, float, float]]] = {v: [] for v in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            run, opt = built[v]
            for i in range(steps + (3 if r == 0 else 1)):
                if world_size > 1:
                    dist.barrier()
                t = phases(run, opt, x)
                if i >= (3 if r == 0 else 1):
                    times[v].append(t)
    return {"times": times, "counts": {v: counts(*built[v], x) for v in names}}


def summarise(ws: int, params: int, names: list[str], per_rank: list[dict]) -> list[dict]:
    rows = []
    for v in names:
        slowest = [tuple(max(step) for step in zip(*steps)) for steps in zip(*(r["times"][v] for r in per_rank))]
        med = {p: statistics.median(s[i] for s in slowest) for i, p in enumerate(PHASES)}
        total = statistics.median(sum(s) for s in slowest)
        c = per_rank[0]["counts"][v]
        rows.append({"world": ws, "params": params, "variant": v, **{f"{p}_ms": med[p] for p in PHASES},
                     "total_ms": total, "us_per_param": 1e3 * total / params, **c})
    base = next((r for r in rows if r["variant"] == "ddp-fused"), rows[0])
    for r in rows:
        r["ratio_to_ddp_fused"] = r["total_ms"] / base["total_ms"]
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in ("variant", "zero_grad ms", "fwd+bwd ms", "step ms", "total ms", "us/param", "vs DDP fused",
              "Python calls", "aten ops"):
        table.add_column(h, justify="left" if h == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], *(f"{r[p + '_ms']:.2f}" for p in PHASES), f"{r['total_ms']:.2f}",
                      f"{r['us_per_param']:.1f}", f"{r['ratio_to_ddp_fused']:.2f}", str(r["python_calls"]),
                      str(r["leaf_aten_ops"]))
    Console(width=150).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="50,300,1000", help="parameter tensors per model (even)")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="smoke test: 20 parameters, 1 and 2 ranks, 1 round x 2 steps")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.rounds, args.steps = "20", 1, 2
    names = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in names if v not in VARIANTS]:
        raise SystemExit(f"--variants: {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    from cocoweave.launch import LocalWorld

    doc: dict[str, Any] = {"command": "benchmarks/host_overhead.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:]),
                           "machine": machine(), "variants": names, "rows": []}
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for ws in (int(w) for w in args.worlds.split(",")):
        with LocalWorld(ws, timeout_s=1800) as world:
            for params in (int(p) for p in args.params.split(",")):
                rows = summarise(ws, params, names, world.run(timings, params, names, args.rounds, args.steps))
                doc["rows"] += rows
                print_table(rows, f"{ws} rank(s), {params} parameter tensors, {args.rounds} rounds x {args.steps} "
                                  "steps, medians of the slowest rank")
    doc["machine"]["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    options = {"params": args.params, "worlds": args.worlds, "quick": args.quick}
    path = results_path(args.out, "host_overhead", ap, options)
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
