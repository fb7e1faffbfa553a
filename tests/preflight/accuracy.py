"""Predicted against measured, on live Gloo ranks (a script, not a test: its figures depend on the machine):

    python tests/preflight/accuracy.py memory [--json PATH]  # per rank: predicted peak vs the CPU allocator's peak
    python tests/preflight/accuracy.py idle [--json PATH]    # pp 2: predicted bubble vs the measured idle share
    python tests/preflight/accuracy.py replay JSON...        # saved idle runs: own stage costs + calibrated link

Each prints a table and writes every figure, with the machine and its load average, to PATH (default
preflight-accuracy-WHAT.json), so that a run on a quiet machine can be compared.

Memory: the whole job (model, optimizer, a warm-up step, the measured step) runs under torch.profiler with
profile_memory, whose "[memory]" events are every allocation and free of the CPU allocator; the measured peak is the
largest sum of live bytes during the second step. Idle: each rank's time inside its stages' forward and backward
calls (and the last stage's loss) against Pipeline.step's wall time, median of 5 steps after 2 warm-ups; the
prediction with unit costs (a forward of the stage's blocks, a backward twice that), calibrated before the timed
steps (each stage's costs timed alone and a receive probe: PipelineJob.stage_costs and link, `calibrate`) and with
the run's own median per-stage costs."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
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
    """Per timed step: the step's wall time, the time inside this rank's stages' forward calls (the last stage's
    loss included: torch computes it outside the forward call, the model counts it in the last stage's forward) and
    backward calls, and inside torch's waits on its sends and receives; and every call's duration."""
    from torch.distributed.pipelining import schedules as S

    torch.manual_seed(0)
    pipe = build(1, pp, schedule, m, d, heads, blocks)
    now: dict[str, float] = {"busy": 0.0, "wait": 0.0}
    calls: dict[str, list[float]] = {}  # this step's call durations, by stage and F (forward), B, L (loss)

    def timed(fn: Any, key: str | None, into: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                now[into] += dt
                if key is not None:
                    calls.setdefault(key, []).append(dt)
        return wrapper

    for sid, st in zip(pipe.stage_ids, pipe.stages):
        st.forward_one_chunk = timed(st.forward_one_chunk, f"{sid}F", "busy")
        st.backward_one_chunk = timed(st.backward_one_chunk, f"{sid}B", "busy")
    last = pipe.num_stages - 1
    pipe.pipeline_schedule._maybe_compute_loss = timed(pipe.pipeline_schedule._maybe_compute_loss, f"{last}L", "busy")
    saved = S._wait_batch_p2p
    S._wait_batch_p2p = timed(saved, None, "wait")
    x = torch.randint(0, V, (n, seq))
    calibration = calibrate(pipe, m, n, seq, d)
    steps = []
    try:
        for s in range(7):
            torch.distributed.barrier()
            calls.clear()
            now["busy"] = now["wait"] = 0.0
            t = time.perf_counter()
            pipe.step(x, x, step=s)
            wall = time.perf_counter() - t
            if s >= 2:
                steps.append({"wall": wall, "busy": now["busy"], "wait": now["wait"], "calls": dict(calls)})
    finally:
        S._wait_batch_p2p = saved
    return {"rank": rank, "steps": steps, "predicted": pipe.check(batch=n, seq=seq, memory=False).bubble(rank),
            "calibration": calibration}


def _busy(ms: float) -> None:
    a = torch.randn(192, 192)
    t = time.perf_counter()
    while (time.perf_counter() - t) * 1e3 < ms:
        a @ a


def calibrate(pipe: Any, m: int, n: int, seq: int, d: int, reps: int = 9) -> dict[str, Any]:
    """Before the timed steps, on both ranks at once (as they will run): this rank's stage's forward (the last
    stage's loss included) and backward of one micro-batch, each timed alone (median of `reps` after a warm-up);
    and the seconds a rank takes to receive a message that arrived while it computed, the sender computing too
    (what a stage's receive is), of half, once and twice the boundary's size, both directions: what
    PipelineJob.stage_costs and link take."""
    import torch.distributed as dist

    rank, mb = dist.get_rank(), n // m
    sub = pipe.stages[0].submod
    first, last = pipe.stages[0].is_first, pipe.stages[0].is_last
    fwd, bwd = [], []
    for i in range(reps + 1):
        x = torch.randint(0, V, (mb, seq)) if first else torch.randn(mb, seq, d, requires_grad=True)
        dist.barrier()
        t = time.perf_counter()
        out = sub(x, step=100 + i, positions=torch.arange(mb))
        if last:
            out = ce(out, torch.randint(0, V, (mb, seq)))
        t1 = time.perf_counter()
        out.backward(None if last else torch.randn_like(out))
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t)
            bwd.append(t2 - t1)
    sub.zero_grad(set_to_none=True)
    receive = {}
    for numel in (mb * seq * d // 2, mb * seq * d, 2 * mb * seq * d):
        got = []
        for src in (0, 1):
            for i in range(reps + 1):
                dist.barrier()
                if rank == src:
                    work = dist.isend(torch.randn(numel), 1 - src)
                    _busy(60)
                    work.wait()
                else:
                    buf = torch.empty(numel)
                    _busy(30)
                    t = time.perf_counter()
                    dist.irecv(buf, src).wait()
                    if i:
                        got.append(time.perf_counter() - t)
        receive[numel] = got
    return {"stage": pipe.stage_ids[0], "forward": statistics.median(fwd), "backward": statistics.median(bwd),
            "receive": {k: v for k, v in receive.items()}}


def _link(calibrations: list[dict[str, Any]]) -> Any:
    """The pricing model's Link (latency + bytes / bandwidth) fitted by least squares through the probed sizes'
    median receive times (a slope that is not positive: the mean time as latency, bandwidth unbounded)."""
    from cocoweave.collectives.pricing import Link

    sizes: dict[int, list[float]] = {}
    for c in calibrations:
        for numel, got in c["receive"].items():
            sizes.setdefault(int(numel), []).extend(got)
    points = [(4.0 * k, statistics.median(v)) for k, v in sizes.items()]
    slope, latency = statistics.linear_regression(*zip(*points))
    if slope <= 0:
        return Link("gloo receive, probed", float("inf"), statistics.mean(t for _, t in points))
    return Link("gloo receive, probed", 1 / slope, max(latency, 0.0))


def _machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def memory_rows() -> list[dict[str, Any]]:
    from cocoweave.launch import LocalWorld

    layouts = [(2, 2, "1f1b", False), (2, 2, "gpipe", True), (1, 4, "gpipe", False), (1, 2, "interleaved1f1b", False)]
    rows = []
    with LocalWorld(4, timeout_s=600) as world:
        for tp, pp, schedule, sp in layouts:
            for r in world.run(memory_case, tp, pp, schedule, 8, 16, 128, 256, 8, 8, sp=sp):
                pred = r["predicted"]
                rows.append({"layout": f"tp{tp} pp{pp} {schedule}{' sp' if sp else ''}", "rank": r["rank"],
                             "measured_MiB": round(r["measured_peak"] / 2**20, 2),
                             "measured_at_step_start_MiB": round(r["at_step_start"] / 2**20, 2),
                             "predicted_MiB": round(pred["total"] / 2**20, 2),
                             "error": round(pred["total"] / r["measured_peak"] - 1, 4),
                             "terms_MiB": {k: round(v / 2**20, 2) for k, v in pred.items() if k != "in_flight"},
                             "in_flight": pred["in_flight"]})
    return rows


def step_costs(ranks: Any, i: int, pp: int) -> dict[int, tuple[float, float]]:
    """Timed step i's mean per-stage costs over the ranks' records: (forward with the last stage's loss, backward)
    of one micro-batch, as PipelineJob.stage_costs takes them."""
    calls = {k: v for r in ranks for k, v in r["steps"][i]["calls"].items()}
    return {s: (statistics.mean(calls[f"{s}F"]) + statistics.mean(calls.get(f"{s}L", [0.0])),
                statistics.mean(calls[f"{s}B"])) for s in range(pp)}


def idle_rows() -> list[dict[str, Any]]:
    """Per schedule and rank: the measured idle share (1 - busy / step, median of the timed steps), the share spent in
    torch's waits, the bubble predicted with unit costs and, step by step, with that step's own mean per-stage costs
    (forward with the loss, backward of one micro-batch: PipelineJob.stage_costs), median."""
    from cocoweave.launch import LocalWorld
    from cocoweave.preflight import PipelineJob, preflight

    rows = []
    n, seq, d, heads, blocks, pp = 16, 128, 512, 8, 8, 2
    with LocalWorld(pp, timeout_s=600) as world:
        for schedule, m in (("1f1b", 4), ("gpipe", 4), ("1f1b", 8), ("gpipe", 8)):
            out = world.run(idle_case, pp, schedule, m, n, seq, d, heads, blocks)
            cal = [r["calibration"] for r in out]
            link = _link(cal)
            with_costs: list[Any] = []  # per timed step: the bubble predicted with that step's own mean costs,
            for i in range(len(out[0]["steps"])):  # without and with the calibrated link
                costs = step_costs(out, i, pp)
                job = PipelineJob(pp=pp, microbatches=m, n_blocks=blocks, batch=n, seq=seq, d_model=d, heads=heads,
                                  schedule=schedule, stage_costs=costs)
                with_costs.append((preflight(job, ranks=[]), costs,
                                   preflight(dataclasses.replace(job, link=link), ranks=[])))
            calibrated = preflight(PipelineJob(pp=pp, microbatches=m, n_blocks=blocks, batch=n, seq=seq, d_model=d,
                                               heads=heads, schedule=schedule, link=link,
                                               stage_costs={c["stage"]: (c["forward"], c["backward"]) for c in cal}),
                                   ranks=[])
            for r in out:
                st = r["steps"]
                idle = [1 - x["busy"] / x["wall"] for x in st]
                own = [rep.bubble(r["rank"]) for rep, _, _ in with_costs]
                own_link = [rep.bubble(r["rank"]) for _, _, rep in with_costs]
                rows.append({"schedule": schedule, "microbatches": m, "rank": r["rank"],
                             "measured_idle": round(statistics.median(idle), 4),
                             "measured_idle_per_step": [round(v, 4) for v in idle],
                             "measured_wait": round(statistics.median(x["wait"] / x["wall"] for x in st), 4),
                             "predicted_unit_costs": round(r["predicted"], 4),
                             "predicted_own_costs": round(statistics.median(own), 4),
                             "predicted_own_costs_per_step": [round(v, 4) for v in own],
                             "predicted_own_costs_and_link": round(statistics.median(own_link), 4),
                             "predicted_calibrated": round(calibrated.bubble(r["rank"]), 4),
                             "calibration": r["calibration"] | {"link_bandwidth_B_s": link.bandwidth,
                                                                "link_latency_s": link.latency},
                             "step_s": round(statistics.median(x["wall"] for x in st), 4),
                             "backward_over_forward": [round(c[s][1] / c[s][0], 3) for _, c, _ in with_costs
                                                       for s in range(pp)],
                             "steps": st})
    return rows


def replay(paths: list[str]) -> None:
    """From saved `idle` JSONs: each rank's measured idle share against the prediction from each timed step's own
    stage costs and the run's calibrated link (what `predicted_own_costs_and_link` holds in newer files); the tally."""
    from cocoweave.preflight import PipelineJob, preflight

    within = total = 0
    worst = 0.0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)["rows"]
        for pair in zip(rows[0::2], rows[1::2]):
            link = _link([r["calibration"] for r in pair])
            job = PipelineJob(pp=2, microbatches=pair[0]["microbatches"], n_blocks=8, batch=16, seq=128, d_model=512,
                              heads=8, schedule=pair[0]["schedule"], link=link)
            reps = []
            for i in range(len(pair[0]["steps"])):
                reps.append(preflight(dataclasses.replace(job, stage_costs=step_costs(pair, i, 2)), ranks=[]))
            for r in pair:
                predicted = statistics.median(rep.bubble(r["rank"]) for rep in reps)
                error = abs(predicted - r["measured_idle"])
                within, total, worst = within + (error <= 0.02), total + 1, max(worst, error)
                print(f"{path}: {r['schedule']}, {r['microbatches']}, rank {r['rank']}: measured "
                      f"{100 * r['measured_idle']:.1f}%, predicted {100 * predicted:.1f}%")
    print(f"{within} of {total} within 2 points; worst {100 * worst:.1f} points")


def main(argv: list[str]) -> None:
    if argv and argv[0] == "replay":
        replay(argv[1:])
        return
    what = argv[0] if argv else "memory"
    path = argv[argv.index("--json") + 1] if "--json" in argv else f"preflight-accuracy-{what}.json"
    before = _machine()
    rows = memory_rows() if what == "memory" else idle_rows()
    doc = {"what": what, "command": "python tests/preflight/accuracy.py " + " ".join(argv), "machine": before,
           "load_average_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    if what == "memory":
        print("| layout | rank | measured peak MiB | predicted MiB | error | measured growth MiB | predicted "
              "activations MiB |")
        for r in rows:
            print(f"| {r['layout']} | {r['rank']} | {r['measured_MiB']} | {r['predicted_MiB']} | "
                  f"{100 * r['error']:+.1f}% | {r['measured_MiB'] - r['measured_at_step_start_MiB']:.1f} | "
                  f"{r['terms_MiB']['activations']} |")
    else:
        print("| schedule, micro-batches | rank | measured idle (steps' range) | in waits | predicted, unit costs | "
              "predicted, calibrated | predicted, each step's own costs | the same and the link | backward / forward "
              "| step s |")
        for r in rows:
            per, ratio = r["measured_idle_per_step"], r["backward_over_forward"]
            print(f"| {r['schedule']}, {r['microbatches']} | {r['rank']} | {100 * r['measured_idle']:.1f}% "
                  f"({100 * min(per):.1f}-{100 * max(per):.1f}) | {100 * r['measured_wait']:.1f}% | "
                  f"{100 * r['predicted_unit_costs']:.1f}% | {100 * r['predicted_calibrated']:.1f}% | "
                  f"{100 * r['predicted_own_costs']:.1f}% | {100 * r['predicted_own_costs_and_link']:.1f}% | "
                  f"{min(ratio):.2f}-{max(ratio):.2f} | {r['step_s']:.2f} |")
    print(f"load average {before['load_average']} before, {doc['load_average_after']} after; JSON: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
