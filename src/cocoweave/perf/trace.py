"""A tiny Chrome/Perfetto trace recorder: per-rank, per-stream spans merged into one trace JSON.

    tracer = Tracer(rank)
    with tracer.span("matmul", stream="compute", chunk=0):
        ...
    events = tracer.events()                       # picklable; return it from a rank function
    merge_and_write([events_rank0, events_rank1], "trace.json")   # open in ui.perfetto.dev or chrome://tracing

Host spans use time.perf_counter_ns (one monotonic clock for all processes of a machine). A span given a
CUDA stream is timed with CUDA events recorded on that stream and placed on the host clock at `events()`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .. import jsonable

Event = dict[str, Any]  # {"name", "rank", "stream", "start_ns", "dur_ns", "chunk", "args"}


class Tracer:
    """Records named spans of one rank on named streams (tracks); `enabled=False` makes spans free."""

    def __init__(self, rank: int = 0, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self._events: list[Event] = []
        self._cuda_pending: list[tuple[Event, Any, Any]] = []
        self._cuda_anchor: tuple[Any, int] | None = None  # (a CUDA event, the host time it completed)

    @contextmanager
    def span(self, name: str, stream: str = "compute", chunk: int | None = None, cuda_stream: Any = None,
             **args: Any) -> Iterator[None]:
        """Time the body as one span named `name` on track `stream` (on `cuda_stream`'s timeline if given)."""
        if not self.enabled:
            yield
            return
        if cuda_stream is not None:
            import torch

            self._anchor()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(cuda_stream)
            try:
                yield
            finally:
                end.record(cuda_stream)
                self._cuda_pending.append((self._event(name, stream, chunk, 0, 0, args), start, end))
            return
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self._events.append(self._event(name, stream, chunk, t0, time.perf_counter_ns() - t0, args))

    def add(self, name: str, start_ns: int, end_ns: int, stream: str = "compute", chunk: int | None = None,
            **args: Any) -> None:
        """Record a span measured elsewhere (perf_counter_ns times)."""
        if self.enabled:
            self._events.append(self._event(name, stream, chunk, start_ns, end_ns - start_ns, args))

    def events(self) -> list[Event]:
        """Every recorded span as plain dicts (waits for pending CUDA spans to complete)."""
        if self._cuda_pending:
            anchor, anchor_ns = self._cuda_anchor  # type: ignore[misc]
            for event, start, end in self._cuda_pending:
                end.synchronize()
                event["start_ns"] = anchor_ns + round(anchor.elapsed_time(start) * 1e6)
                event["dur_ns"] = round(start.elapsed_time(end) * 1e6)
                self._events.append(event)
            self._cuda_pending.clear()
        return sorted(self._events, key=lambda e: e["start_ns"])

    def clear(self) -> None:
        """Forget every recorded span."""
        self.events()
        self._events.clear()

    def _event(self, name: str, stream: str, chunk: int | None, start_ns: int, dur_ns: int,
               args: dict[str, Any]) -> Event:
        return {"name": name, "rank": self.rank, "stream": stream, "start_ns": start_ns, "dur_ns": dur_ns,
                "chunk": chunk, "args": dict(args)}

    def _anchor(self) -> None:
        """Tie the CUDA timeline to the host clock once: an event recorded when the device is idle."""
        if self._cuda_anchor is None:
            import torch

            torch.cuda.synchronize()
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self._cuda_anchor = (anchor, time.perf_counter_ns())


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def merge(per_rank_events: Sequence[Sequence[Event]] | Mapping[int, Sequence[Event]]) -> dict[str, Any]:
    """One Chrome trace (dict) from each rank's events: pid = rank, one thread (track) per stream."""
    items = per_rank_events.items() if isinstance(per_rank_events, Mapping) else enumerate(per_rank_events)
    ranks: dict[int, list[Event]] = {}
    for index, events in items:
        for e in events:
            ranks.setdefault(int(e.get("rank", index)), []).append(e)
        ranks.setdefault(int(index), [])
    streams: dict[str, int] = {}
    for rank in sorted(ranks):
        for e in ranks[rank]:
            streams.setdefault(str(e["stream"]), len(streams) + 1)
    t0 = min((e["start_ns"] for evs in ranks.values() for e in evs), default=0)
    out: list[dict[str, Any]] = []
    for rank in sorted(ranks):
        out.append(_meta("process_name", rank, 0, name=f"rank {rank}"))
        out.append(_meta("process_sort_index", rank, 0, sort_index=rank))
        for stream in sorted({str(e["stream"]) for e in ranks[rank]}, key=streams.__getitem__):
            tid = streams[stream]
            out.append(_meta("thread_name", rank, tid, name=stream))
            out.append(_meta("thread_sort_index", rank, tid, sort_index=tid))
        for e in ranks[rank]:
            args = dict(e.get("args") or {})
            if e.get("chunk") is not None:
                args["chunk"] = e["chunk"]
            out.append({"ph": "X", "name": str(e["name"]), "cat": str(e["stream"]), "pid": rank,
                        "tid": streams[str(e["stream"])], "ts": (e["start_ns"] - t0) / 1e3,
                        "dur": e["dur_ns"] / 1e3, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def merge_and_write(per_rank_events: Sequence[Sequence[Event]] | Mapping[int, Sequence[Event]],
                    path: str | os.PathLike[str]) -> dict[str, Any]:
    """Merge each rank's events (see `merge`), write them to `path` as Chrome trace JSON; return it."""
    trace = merge(per_rank_events)
    with open(path, "w", encoding="utf-8") as f:
        f.write(jsonable.dumps(trace))
    return trace
