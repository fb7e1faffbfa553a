"""What one profiled world's ranks recorded of their I/O (`io_recorder`), summarised: the input pipeline per step,
every checkpoint save and load, host-device transfers; and the sentences the profile and the planner say of them.

A world's input figures are per-rank medians over the timed steps (times) or means (bytes, batches), averaged over
the ranks, as the profiler does for the phases. Checkpoints are taken from every step, warm-up included (a script
checkpoints every K steps, so most steps have none): per operation, the calls, mean time and bytes, the write or
read bandwidth, and the slowest rank's mean time (a checkpoint every rank writes lasts as long as the slowest).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from cocoweave.cluster.profiling.io_recorder import ASYNC_NOTE, NO_GPU_NOTE

TIMES = ("data_wait_ms", "data_cpu_ms", "worker_cpu_ms")
AMOUNTS = ("batches", "read_bytes", "rchar", "wchar", "worker_read_bytes", "worker_rchar", "worker_wchar")
SAVES = ("torch.save", "dcp.save", "cocoweave.checkpoint.save")


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def summarise_io(timed: Sequence[Sequence[dict[str, Any]]], every: Sequence[Sequence[dict[str, Any]]]) -> dict:
    """One world's I/O from each rank's timed step records and all its step records ({} if none carry I/O)."""
    timed_io = [[s["io"] for s in steps if s.get("io")] for steps in timed]
    if not all(timed_io) or not timed_io:
        return {}
    doc: dict[str, Any] = {}
    for k in TIMES:
        doc[k] = statistics.fmean(_median([s.get(k, 0.0) for s in steps]) for steps in timed_io)
    for k in AMOUNTS:
        doc[k] = statistics.fmean(statistics.fmean(s.get(k, 0) for s in steps) for steps in timed_io)
    doc["loaders"] = timed_io[0][-1].get("loaders", [])
    doc["workers_alive"] = timed_io[0][-1].get("workers_alive", 0)
    doc["checkpoints"] = checkpoint_stats([[c for s in steps if s.get("io") for c in s["io"]["checkpoints"]]
                                           for steps in every])
    transfers = [[s["transfers"] for s in steps if s.get("transfers")] for steps in timed_io]
    if all(transfers):
        doc["transfers"] = {"device": "gpu", "note": ASYNC_NOTE, **{
            k: statistics.fmean(_median([t[k] for t in steps]) for steps in transfers)
            for k in ("ms", "bytes", "count", "async", "pinned")}}
    else:
        doc["transfers"] = {"device": "cpu", "note": NO_GPU_NOTE, "ms": 0.0, "bytes": 0.0, "count": 0.0}
    return doc


def checkpoint_stats(per_rank: Sequence[Sequence[Sequence[Any]]]) -> dict[str, dict[str, float]]:
    """Per operation label: calls, mean ms and bytes, MB/s, and the slowest rank's mean ms, from each rank's
    [label, ms, bytes] events."""
    out: dict[str, dict[str, float]] = {}
    labels = sorted({e[0] for events in per_rank for e in events})
    for label in labels:
        mine = [[e for e in events if e[0] == label] for events in per_rank]
        flat = [e for events in mine for e in events]
        ms, nbytes = sum(e[1] for e in flat), sum(e[2] for e in flat)
        out[label] = {"count": float(len(flat)), "ms": ms / len(flat), "bytes": nbytes / len(flat),
                      "mb_per_s": (nbytes / 1e6) / (ms / 1e3) if ms > 0 else 0.0,
                      "slowest_rank_ms": max(statistics.fmean(e[1] for e in events) for events in mine if events),
                      "ranks": float(sum(1 for events in mine if events))}
    return out


def merge_io(ios: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several rounds of one world as one: means of the per-step figures, checkpoints weighted by their calls."""
    ios = [io for io in ios if io]
    if len(ios) < 2:
        return ios[0] if ios else {}
    doc = dict(ios[-1])
    for k in (*TIMES, *AMOUNTS):
        doc[k] = statistics.fmean(io.get(k, 0.0) for io in ios)
    merged: dict[str, dict[str, float]] = {}
    for label in sorted({label for io in ios for label in io.get("checkpoints", {})}):
        parts = [io["checkpoints"][label] for io in ios if label in io.get("checkpoints", {})]
        n = sum(p["count"] for p in parts)
        ms, nbytes = sum(p["ms"] * p["count"] for p in parts), sum(p["bytes"] * p["count"] for p in parts)
        merged[label] = {"count": n, "ms": ms / n, "bytes": nbytes / n,
                         "mb_per_s": (nbytes / 1e6) / (ms / 1e3) if ms > 0 else 0.0,
                         "slowest_rank_ms": max(p["slowest_rank_ms"] for p in parts),
                         "ranks": max(p["ranks"] for p in parts)}
    doc["checkpoints"] = merged
    if all(io.get("transfers", {}).get("device") == "gpu" for io in ios):
        doc["transfers"] = {**ios[-1]["transfers"], **{k: statistics.fmean(io["transfers"][k] for io in ios)
                                                       for k in ("ms", "bytes", "count", "async", "pinned")}}
    return doc


def input_wait_ms(io: dict[str, Any]) -> float:
    """Wall time per step a rank waited for its data (inside the DataLoader), ms."""
    return float(io.get("data_wait_ms", 0.0))


def input_main_cpu_ms(io: dict[str, Any]) -> float:
    """CPU time per step the rank's own thread spent making data (a loader without workers decodes here), ms."""
    return min(float(io.get("data_cpu_ms", 0.0)), input_wait_ms(io))


def input_cpu_ms(io: dict[str, Any]) -> float:
    """CPU time per step of a rank's input pipeline: its own thread's and its loader workers', ms."""
    return input_main_cpu_ms(io) + float(io.get("worker_cpu_ms", 0.0))


def input_hint(io: dict[str, Any]) -> str:
    """What to change when the input pipeline binds, from the loaders the script used."""
    loaders = io.get("loaders") or []
    read_mb = (float(io.get("rchar", 0.0)) + float(io.get("worker_rchar", 0.0))) / 1e6
    volume = f"; a rank reads {read_mb:.1f} MB per step" if read_mb >= 0.1 else ""
    if not loaders:
        return "make the batches ahead of the loop or in a DataLoader with workers, or pre-tokenise" + volume
    workers = max(int(loader["num_workers"]) for loader in loaders)
    if workers == 0:
        return f"raise num_workers from 0, or pre-tokenise{volume}"
    depth = max(int(loader.get("prefetch_factor") or 2) for loader in loaders)
    return f"raise num_workers from {workers} (prefetch depth {depth} batches per worker), or pre-tokenise{volume}"


def measured_checkpoint(io: dict[str, Any]) -> tuple[float, float, str] | None:
    """(seconds, bytes, label) of the slowest save operation recorded, as one checkpoint of the run; None when the
    run saved nothing."""
    saves = {k: v for k, v in (io.get("checkpoints") or {}).items() if k in SAVES}
    if not saves:
        return None
    label, stats = max(saves.items(), key=lambda kv: kv[1]["slowest_rank_ms"])
    return stats["slowest_rank_ms"] / 1e3, stats["bytes"] * stats["ranks"], label


def transfer_sentence(io: dict[str, Any]) -> str | None:
    """What a rank copied between host and device per step (the run's transfers), or None on a host without a
    GPU, where nothing is copied."""
    t = io.get("transfers") or {}
    if t.get("device") != "gpu":
        return None
    note = f": {t['note']}" if t["async"] else ""
    return (f"host-device copies: {t['count']:.0f} per step, {t['bytes'] / 1e6:.2f} MB in {t['ms']:.2f} ms "
            f"({t['pinned']:.0f} from pinned memory, {t['async']:.0f} non-blocking{note})")
