"""`cocoweave perf calibrate`: microbenchmarks on a local world, fitted into a `Calibration`.

Every rank runs the same benchmarks at once (kernels too: on a shared machine they compete for the
same cores, as they do in a real step): each collective by algorithm at a few sizes, point-to-point
between rank pairs, an elementwise kernel and a matmul per dtype. A timing is the slowest rank's
time of one iteration (after a barrier), the median over iterations. The raw timings go to the
measurement store; the fitted alpha-beta lines to `calibration_path(...)`.
"""

from __future__ import annotations

import statistics
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import collectives
from ..backends.torch.ring import ring_all_gather, ring_reduce_scatter
from ..backends.torch.worker import timed_steps
from ..collectives import pricing
from ..ir.types import DTYPES
from .costmodel import AlphaBeta, Calibration, fit_alpha_beta

COLLECTIVE_ELEMENTS = (1 << 10, 1 << 15, 1 << 19)  # float32 elements per rank's full tensor
KERNEL_ELEMENTS = (1 << 10, 1 << 15, 1 << 18, 1 << 21)
MATMUL_SIZES = (32, 96, 192)  # square matrices
DTYPES_CALIBRATED = ("float32", "float16", "bfloat16")


@dataclass
class Spec:
    """What one calibration run measures."""

    collective_elements: tuple[int, ...] = COLLECTIVE_ELEMENTS
    kernel_elements: tuple[int, ...] = KERNEL_ELEMENTS
    matmul_sizes: tuple[int, ...] = MATMUL_SIZES
    dtypes: tuple[str, ...] = DTYPES_CALIBRATED
    iters: int = 5
    warmup: int = 2
    device: str = "cpu"


def _timed(fn: Callable[[], Any], iters: int, warmup: int, world_size: int, device: torch.device) -> list[float]:
    return timed_steps(fn, world_size, device, iters, warmup)


def _collectives(world_size: int, rank: int, n: int, dev: torch.device) -> dict[str, tuple[float, Callable[[], Any]]]:
    """name -> (bytes moved per rank, the call) for a float32 tensor of n elements (a multiple of p): each collective
    kind's library call, the ring's, point to point; what each moves is the table of collective algorithms'
    (cocoweave.collectives)."""
    p = world_size
    x = torch.randn(n, device=dev)
    part = torch.empty(n // p, device=dev)
    full = torch.empty(n // p * p, device=dev)
    # the buffers each collective kind's benchmark reads (collectives/kinds.py): its library call, timed
    buffers = types.SimpleNamespace(x=x, part=part, full=full, exchanged=torch.empty(n, device=dev), p=p, rank=rank)
    whole = 4 * n
    calls: dict[str, Callable[[], Any]] = {
        **{f"{k.name}/{collectives.DEFAULT}": k.benchmark(buffers) for k in collectives.all_kinds() if k.benchmark},
        "reduce_scatter/ring": lambda: ring_reduce_scatter(x, 0, "sum", None, part),
        "all_gather/ring": lambda: ring_all_gather(part, 0, None, full),
        "all_reduce/ring": lambda: (ring_reduce_scatter(x, 0, "sum", None, part), ring_all_gather(part, 0, None, x)),
    }
    if p % 2 == 0:
        peer = rank ^ 1
        buf = torch.empty(n, device=dev)

        def p2p() -> None:
            ops = [dist.P2POp(dist.isend if rank % 2 == 0 else dist.irecv, x if rank % 2 == 0 else buf, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        calls["p2p/library"] = p2p
    return {key: (_moved(key, p) * whole, call) for key, call in calls.items()}


def _moved(key: str, p: int) -> float:
    """The fraction of its tensor a rank moves in benchmark `key` ("all_reduce/ring") at p ranks."""
    op, algorithm = key.split("/")
    return pricing.moved(op, p, algorithm)


def microbench(rank: int, world_size: int, spec: Spec) -> list[dict[str, Any]]:
    """Run on every rank: the timings of every benchmark, as rows {name, kind, key, amount, times_ms}."""
    dev = torch.device(spec.device)
    torch.manual_seed(rank)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # *_tensor names
    rows: list[dict[str, Any]] = []
    if world_size > 1:
        for n in spec.collective_elements:
            n = max(n // world_size * world_size, world_size)
            for key, (moved, call) in _collectives(world_size, rank, n, dev).items():
                rows.append({"kind": "comm", "key": key, "elements": n, "amount": moved,
                             "times_ms": _timed(call, spec.iters, spec.warmup, world_size, dev)})
    for dtype in spec.dtypes:
        dt = DTYPES[dtype]
        for n in spec.kernel_elements:
            a, b, c = (torch.randn(n, device=dev).to(dt) for _ in range(3))
            traffic = 4 * n * dt.itemsize  # three reads, one write
            # a fresh result per call, as the generated eager code allocates one per op
            rows.append({"kind": "kernel", "key": dtype, "elements": n, "amount": traffic,
                         "times_ms": _timed(lambda a=a, b=b, c=c: torch.addcmul(c, a, b), spec.iters, spec.warmup,
                                            world_size, dev)})
        for m in spec.matmul_sizes:
            a, b = torch.randn(m, m, device=dev).to(dt), torch.randn(m, m, device=dev).to(dt)
            rows.append({"kind": "matmul", "key": dtype, "elements": m * m, "amount": 2.0 * m ** 3,
                         "times_ms": _timed(lambda a=a, b=b: torch.matmul(a, b), spec.iters, spec.warmup,
                                            world_size, dev)})
    return rows


def combine(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per benchmark: the slowest rank's time of each iteration, and the median of those (`ms`)."""
    out = []
    for rows in zip(*per_rank, strict=True):
        worst = [max(ts) for ts in zip(*(r["times_ms"] for r in rows), strict=True)]
        out.append({k: v for k, v in rows[0].items() if k != "times_ms"} | {"times_ms": worst,
                                                                           "ms": statistics.median(worst)})
    return out


def fit(rows: list[dict[str, Any]], backend: str, device: str, world_size: int,
        meta: Mapping[str, Any] | None = None) -> Calibration:
    """Fit one alpha-beta line per (kind, key) to the combined timings."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["key"]), []).append(r)
    lines: dict[str, dict[str, AlphaBeta]] = {"comm": {}, "kernel": {}, "matmul": {}}
    for (kind, key), rs in groups.items():
        lines[kind][key] = fit_alpha_beta([r["amount"] for r in rs], [max(r["ms"], 1e-6) for r in rs])
    chunk = lines["kernel"].get("float32", AlphaBeta(0.01, 0.0)).alpha_ms  # a part call per chunk
    return Calibration(backend=backend, device=device, world_size=world_size, collectives=lines["comm"],
                       kernels=lines["kernel"], matmuls=lines["matmul"], chunk_overhead_ms=chunk,
                       fused_kernels=device == "cuda", meta=dict(meta or {}))
