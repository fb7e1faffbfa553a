"""The plain PyTorch baselines of the paper's three workloads, written as a competent user would write them (run
on every rank of a world), timed with the protocol the schedules use (`timed_steps`: a barrier before each step,
warm-up steps, then one wall time per step). Each workload has several; the report compares the schedules with
the fastest of them (the strongest), and names each one.

- adam: the gradient all-reduced in place (DDP's bucket: one flat buffer, the parameters' gradients are views of
  it, divided by the world size), then torch.optim.Adam(fused=True) over the parameters; or, DDP-style, the same
  all-reduce then torch's ZeroRedundancyOptimizer (each rank updates its share of the parameters with fused Adam
  and broadcasts it). The N elements are 16 parameters of N/16, so that ZeRO can share them out.
- model_parallel: the rank's slices multiplied, the partial sums all-reduced, then bias + dropout + residual, as
  one torch.compile'd function (compiled once per world, before the timed steps) or eager.
- pipeline_parallel: the stage's partial sums all-reduced, the same epilogue (compiled or eager), and the whole
  result sent to the peer rank of the next stage, which receives it.

F.dropout draws a fresh mask every step, as training needs; the schedules get a new seed every step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..backends.torch.worker import timed_steps
from ..ir.layout import slice_bounds
from ..launch import rank_device, rank_state

DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PARAMS = 16  # the Adam baselines' N elements as this many parameters (a model has many; ZeRO shares them out)
LR = 1e-3


@dataclass(frozen=True)
class Baseline:
    """One plain PyTorch baseline: its name in the tables, and the function every rank runs to time it
    (rank, world size, sizes, iters, warmup, dtype) -> step times in ms."""

    name: str
    run: Callable[..., list[float]]


def _gen(rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1234 + rank)


def adam_step(rank: int, world_size: int, n: int, zero: bool) -> tuple[Callable[[], None], list[torch.nn.Parameter]]:
    """One data-parallel Adam step on this rank's random gradient of `n` elements: all-reduce of the flat gradient
    (in place, then / world size), then Adam(fused=True) or ZeRO's step; and the parameters it updates."""
    dev = rank_device()
    grad = torch.randn(n, generator=_gen(rank)).to(dev)  # the bucket; after the first step every rank's is the mean
    weights = torch.randn(n, generator=_gen(0)).to(dev)
    bounds = [slice_bounds(n, PARAMS, i) for i in range(PARAMS)]
    params = [torch.nn.Parameter(weights[s:e].clone()) for s, e in bounds]
    for p, (s, e) in zip(params, bounds):
        p.grad = grad[s:e]  # views of the bucket, as DDP's gradient_as_bucket_view
    if zero and dist.is_initialized():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: Any = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, parameters_as_bucket_view=True,
                                           lr=LR, fused=True)
    else:
        opt = torch.optim.Adam(params, lr=LR, fused=True)

    def step() -> None:
        if world_size > 1:
            dist.all_reduce(grad)
            grad.div_(world_size)
        opt.step()

    return step, params


def _adam(rank: int, world_size: int, sizes: Mapping[str, int], iters: int, warmup: int, dtype: str,
          zero: bool) -> list[float]:
    """`adam_step` timed (float32, as the program)."""
    step, _ = adam_step(rank, world_size, sizes["N"], zero)
    return timed_steps(step, world_size, rank_device(), iters, warmup)


def _epilogue(y: torch.Tensor, b: torch.Tensor, r: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(y + b, p, training=True) + r


def epilogue(compiled: bool, shape: tuple[int, ...], dtype: torch.dtype, p: float) -> Callable[..., torch.Tensor]:
    """bias + dropout + residual, eager or torch.compile'd; a compiled one is compiled once per rank process and
    (shape, dtype, p), on its first call (which the warm-up steps make)."""
    if not compiled:
        return lambda y, b, r: _epilogue(y, b, r, p)
    cache = rank_state().setdefault("demo_compiled_epilogues", {})
    key = (shape, dtype, p)
    if key not in cache:
        import torch._inductor.config as inductor

        inductor.compile_threads = 1  # ranks share the cores
        fn = torch.compile(_epilogue, fullgraph=True, dynamic=False)
        cache[key] = lambda y, b, r: fn(y, b, r, p)
    return cache[key]


def _model_parallel(rank: int, world_size: int, sizes: Mapping[str, int], iters: int, warmup: int, dtype: str,
                    compiled: bool, p: float = 0.1) -> list[float]:
    """x_r @ w_r (the rank's slices), AllReduce of the partial sums, then dropout(y + b) + r."""
    dev, dt = rank_device(), DTYPE[dtype]
    B, S, H = sizes["B"], sizes["S"], sizes["H"]
    lo, hi = slice_bounds(H, world_size, rank)
    x = torch.randn(B, S, hi - lo, generator=_gen(rank)).to(dev, dt)
    w = torch.randn(hi - lo, H, generator=_gen(rank)).to(dev, dt)
    b = torch.randn(H, generator=_gen(0)).to(dev, dt)
    r = torch.randn(B, S, H, generator=_gen(0)).to(dev, dt)
    epi = epilogue(compiled, (B, S, H), dt, p)

    def step() -> None:
        y = torch.matmul(x, w)
        if world_size > 1:
            dist.all_reduce(y)
        epi(y, b, r)

    return timed_steps(step, world_size, dev, iters, warmup)


def _pipeline(rank: int, world_size: int, sizes: Mapping[str, int], iters: int, warmup: int, dtype: str,
              compiled: bool, p: float = 0.1) -> list[float]:
    """Stage 0 (the first half of the ranks): AllReduce of the partial sums in the stage (in place), dropout(y + b)
    + r, then the whole result sent to rank i of stage 1, which receives it. Under Gloo with CUDA tensors the
    message crosses in host memory, as the schedules' does (Gloo's send and recv take no CUDA pointer)."""
    from ..backends.torch.executable import process_groups
    from ..workloads import boundary

    dev, dt = rank_device(), DTYPE[dtype]
    B, S, H = sizes["B"], sizes["S"], sizes["H"]
    half = world_size // 2
    group = process_groups(boundary(B, S, H, dtype), world_size)["stage0"]  # the groups the schedules use
    buf = torch.empty(B, S, H, dtype=dt, device=dev)
    y = torch.randn(B, S, H, generator=_gen(rank)).to(dev, dt)  # reduced in place: no copy (values do not time)
    b = torch.randn(H, generator=_gen(0)).to(dev, dt)
    r = torch.randn(B, S, H, generator=_gen(0)).to(dev, dt)
    epi = epilogue(compiled, (B, S, H), dt, p)
    host = dev.type != "cpu" and dist.get_backend() == "gloo"
    wire = torch.empty(B, S, H, dtype=dt) if host else buf

    def step() -> None:
        if rank < half:
            if half > 1:
                dist.all_reduce(y, group=group)
            out = epi(y, b, r)
            dist.send(out.cpu() if host else out, rank + half)
        else:
            dist.recv(wire, rank - half)
            if host:
                buf.copy_(wire)

    return timed_steps(step, world_size, dev, iters, warmup)


BASELINES: dict[str, tuple[Baseline, ...]] = {
    "adam": (Baseline("AllReduce + torch.optim.Adam(fused=True)", partial(_adam, zero=False)),
             Baseline("AllReduce + ZeroRedundancyOptimizer(Adam, fused=True)", partial(_adam, zero=True))),
    "model_parallel": (
        Baseline("matmul + AllReduce + torch.compile'd epilogue", partial(_model_parallel, compiled=True)),
        Baseline("matmul + AllReduce + eager epilogue", partial(_model_parallel, compiled=False))),
    "pipeline_parallel": (
        Baseline("AllReduce + torch.compile'd epilogue + full send", partial(_pipeline, compiled=True)),
        Baseline("AllReduce + eager epilogue + full send", partial(_pipeline, compiled=False))),
}
