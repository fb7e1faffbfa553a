"""Predicted against measured, on live Gloo ranks (a script, not a test: its figures depend on the machine):

    python tests/preflight/accuracy.py memory     # per rank: predicted peak vs the CPU allocator's peak in a step
    python tests/preflight/accuracy.py idle       # pp 2: predicted bubble vs the measured idle share

Memory: the whole job (model, optimizer, a warm-up step, the measured step) runs under torch.profiler with
profile_memory, whose "[memory]" events are every allocation and free of the CPU allocator; the measured peak is the
largest sum of live bytes during the second step. Idle: each rank's time inside its stages' forward and backward
calls against the schedule's step, median of 5 steps after 2 warm-ups."""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

V = 64


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def build(tp: int, pp: int, schedule: str, m: int, d: int, heads: int, blocks: int, sp: bool = False) -> Any:
    from cocoweave.nn import TransformerBlock, parallel_mesh
    from cocoweave.nn.pipeline import Pipeline

    mesh = parallel_mesh(tensor_parallel=tp, pipeline_parallel=pp)
    return Pipeline(mesh, n_blocks=blocks, block=lambda i: TransformerBlock(d, heads, dropout=0.1, seed=i,
                                                                           group=mesh.get_group("tp"),
                                                                           sequence_parallel=sp),
                    first=lambda: nn.Embedding(V, d), last=lambda: nn.Linear(d, V), loss_fn=ce, microbatches=m,
                    pipeline_schedule=schedule, sequence_parallel=sp)


def memory_case(rank: int, world_size: int, tp: int, pp: int, schedule: str, m: int, n: int, seq: int, d: int,
                heads: int, blocks: int, sp: bool = False) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    from cocoweave.optim import DistributedAdamW

    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pipe = build(tp, pp, schedule, m, d, heads, blocks, sp)
        dp = pipe.dp_size
        x = torch.randint(0, V, (n // dp, seq))
        opt = DistributedAdamW(list(pipe.parameters()), process_group=pipe.dp_group)
        for s in range(2):
            with record_function(f"measured_step{s}"):
                pipe.step(x, x, step=s, no_sync=opt.no_sync)
                opt.step()
                opt.zero_grad()
    kineto = prof.profiler.kineto_results.events()  # "[memory]": each allocation (+bytes) and free (-bytes)
    events = sorted((e for e in kineto if e.name() == "[memory]"), key=lambda e: e.start_ns())
    window = next(e for e in kineto if e.name() == "measured_step1")
    live, peak, start = 0, 0, None
    for e in events:
        if e.start_ns() >= window.start_ns() and start is None:
            start = live
        live += e.nbytes()
        if window.start_ns() <= e.start_ns() <= window.end_ns():
            peak = max(peak, live)
    report = pipe.check(batch=n // dp, seq=seq)
    predicted = report.memory[rank]
    return {"rank": rank, "measured_peak": peak, "at_step_start": start, "predicted": predicted.to_json()}


def idle_case(rank: int, world_size: int, pp: int, schedule: str, m: int, n: int, seq: int, d: int, heads: int,
              blocks: int) -> dict[str, Any]:
    torch.manual_seed(0)
    pipe = build(1, pp, schedule, m, d, heads, blocks)
    busy = [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - t
        return wrapper

    for st in pipe.stages:
        st.forward_one_chunk = timed(st.forward_one_chunk)
        st.backward_one_chunk = timed(st.backward_one_chunk)
    x = torch.randint(0, V, (n, seq))
    shares = []
    for s in range(7):
        torch.distributed.barrier()
        busy[0] = 0.0
        t = time.perf_counter()
        pipe.step(x, x, step=s)
        wall = time.perf_counter() - t
        if s >= 2:
            shares.append(1 - busy[0] / wall)
    return {"rank": rank, "idle": statistics.median(shares),
            "predicted": pipe.check(batch=n, seq=seq, memory=False).bubble(rank)}


def main(what: str) -> None:
    from cocoweave.launch import LocalWorld

    if what == "memory":
        layouts = [(2, 2, "1f1b", False), (2, 2, "gpipe", True), (1, 4, "gpipe", False), (1, 2, "interleaved1f1b",
                                                                                            False)]
        with LocalWorld(4, timeout_s=600) as world:
            for tp, pp, schedule, sp in layouts:
                out = world.run(memory_case, tp, pp, schedule, 8, 16, 128, 256, 8, 8, sp=sp)
                for r in out:
                    pred = r["predicted"]["total"]
                    print(json.dumps({"layout": f"tp{tp} pp{pp} {schedule}{' sp' if sp else ''}", "rank": r["rank"],
                                      "measured_MiB": round(r["measured_peak"] / 2**20, 2),
                                      "measured_at_step_start_MiB": round(r["at_step_start"] / 2**20, 2),
                                      "predicted_MiB": round(pred / 2**20, 2),
                                      "error": round(pred / r["measured_peak"] - 1, 3),
                                      "terms_MiB": {k: round(v / 2**20, 2) for k, v in r["predicted"].items()
                                                    if k != "in_flight"},
                                      "in_flight": r["predicted"]["in_flight"]}))
    else:
        with LocalWorld(2, timeout_s=600) as world:
            for schedule, m in (("1f1b", 4), ("gpipe", 4), ("1f1b", 8), ("gpipe", 8)):
                out = world.run(idle_case, 2, schedule, m, 16, 128, 512, 8, 8)
                for r in out:
                    print(json.dumps({"schedule": schedule, "microbatches": m, "rank": r["rank"],
                                      "measured_idle": round(r["idle"], 4), "predicted": round(r["predicted"], 4)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "memory")
