"""Step time of the dropless MoE experts' programs (workloads.moe_dropless and its backward) as written, fused, and
with dispatch -> expert GEMMs -> combine in 2 and 4 row-set chunks (schedule/rows.py), each on the library's
exchanges (Gloo) and on shared memory: CPU ranks of one host, schedules taking turns in rounds, the median over
steps of the slowest rank's time (worker.step_time_ms).

    .venv/bin/python benchmarks/moe_chunks.py --world 2 --rows 1024 --rounds 5 --iters 4
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from cocoweave import workloads
from cocoweave.backends import reference
from cocoweave.backends.torch.worker import step_times, time_schedule
from cocoweave.launch import LocalWorld
from cocoweave.schedule.enumerate import enumerate_schedules


def inputs(world: int, experts: int, rows: int, d: int, f: int, seed: int = 0) -> list[dict]:
    """Each rank's `rows` rows routed to experts uniformly at random (sorted by destination, then local expert)."""
    g = torch.Generator().manual_seed(seed)
    per = experts // world
    hits = [torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts).view(world, per)
            for _ in range(world)]  # hits[i][j, e]: rank i's rows for rank j's local expert e
    return [{"x": torch.randn(rows, d, generator=g), "s": hits[j].sum(1), "r": torch.stack([h[j].sum() for h in hits]),
             "c": torch.stack([h[j] for h in hits]), "w1": torch.randn(per, d, f, generator=g) / d ** 0.5,
             "w3": torch.randn(per, d, f, generator=g) / d ** 0.5, "w2": torch.randn(per, f, d, generator=g) / f ** 0.5}
            for j in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--f", type=int, default=896)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--json", default=None, help="write the medians here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    fwd = workloads.moe_dropless(R=a.world, E=a.experts, N=a.rows, D=a.d, F=a.f, save=True)
    bwd = workloads.moe_dropless_backward(R=a.world, E=a.experts, N=a.rows, D=a.d, F=a.f)
    ins = inputs(a.world, a.experts, a.rows, a.d, a.f)
    saved = [r.outputs for r in reference.run(fwd, ins)]
    bins = [{"g": torch.randn(i["x"].shape), "s": i["s"], "r": i["r"], "c": i["c"],
             **{k: t for k, t in o.items() if k in bwd.inputs},
             **{f"{k}t": i[k].transpose(1, 2).contiguous() for k in ("w1", "w3", "w2")}} for i, o in zip(ins, saved)]
    out: dict[str, dict[str, float]] = {}
    with LocalWorld(a.world, timeout_s=600.0) as ranks:
        for p, given in ((fwd, ins), (bwd, bins)):
            found = enumerate_schedules(p)
            times: dict[str, list[float]] = {s.name: [] for s in found}
            for _ in range(a.rounds):
                for s in found:
                    got = ranks.run(time_schedule, s, given, {}, iters=a.iters, warmup=1)
                    times[s.name] += step_times([g["times_ms"] for g in got])
            base = statistics.median(times[found[0].name])
            out[p.name] = {n: statistics.median(t) for n, t in times.items()}
            for n, t in times.items():
                m = statistics.median(t)
                print(f"{p.name:24s} {n:44s} {m:8.2f} ms  {m / base:5.2f}x as written")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "median_ms": out}, fh, indent=2)


if __name__ == "__main__":
    main()
