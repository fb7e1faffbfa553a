"""Fixtures of the cluster tests: measured worlds (`WorldRun`) made from a known step model; a call bounded in time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from cocoweave.cluster.profiling.worlds import WorldRun


@pytest.fixture
def make_run() -> Callable[..., WorldRun]:
    """`make_run(p, step_ms, cpu_main_ms, cpu_other_ms, flops, collectives=..., ...)`: a WorldRun as the profiler
    summarises one (per-rank FLOPs split half forward+backward, half update; one counted matmul-like op)."""

    def make(p: int, step_ms: float, cpu_main_ms: float, cpu_other_ms: float, flops: float,
             collectives: dict[str, tuple[float, float]] | None = None, param_bytes: float = 4e6,
             state_bytes: float = 8e6, nbytes: float | None = None, ops: int = 100) -> WorldRun:
        nbytes = flops / 4 if nbytes is None else nbytes
        colls = {f"{kind}/p{p}": {"count": n, "bytes": b, "ms": 0.0}
                 for kind, (n, b) in (collectives or {}).items()} if p > 1 else {}
        hist = [[flops / ops, nbytes / ops, "float32", ops]]
        counts = {"forward_backward": {"flops": flops, "bytes": nbytes, "ops": float(ops), "histogram": hist},
                  "update": {"flops": 0.0, "bytes": 0.0, "ops": 0.0, "histogram": []}}
        return WorldRun(p, step_ms, [step_ms] * 5, {"data_ms": 0.0, "forward_ms": step_ms / 3,
                                                    "backward_ms": step_ms / 3, "update_ms": step_ms / 3},
                        {"cpu_main_ms": cpu_main_ms, "cpu_other_ms": cpu_other_ms}, colls, None, counts,
                        "torch.optim.adamw.AdamW", param_bytes, state_bytes, 1, [0.5, 0.5, 0.5], 3.0,
                        [step_ms] * p, 0.0)

    return make


@pytest.fixture
def returns_within() -> Callable[..., Any]:
    """`returns_within(fn, seconds=60)`: fn()'s result or the exception it raised, asserting it came back within
    `seconds` (run in a daemon thread, so an input that hangs fails the test instead of hanging the suite). The
    default is far above a bounded call's time even on a loaded host; the unbounded ones took minutes."""

    def call(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                box["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(seconds)
        assert not thread.is_alive(), f"the call did not return within {seconds} s"
        return box.get("error", box.get("value"))

    return call
