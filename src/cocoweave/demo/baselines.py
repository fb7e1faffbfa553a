"""The plain baselines of the paper's three workloads, written as a user would write them in torch
(run on every rank of a world), and the timing protocol they share with the torch backend's
`time_schedule`: a barrier before each step, warm-up steps, then one wall time per step.

- adam: all_reduce the gradient (sum, then divide: DDP's average) + torch.optim.Adam(foreach=True).step()
- model_parallel: matmul of the rank's slices + all_reduce of the partial sums + eager bias, dropout, residual
- pipeline_parallel: all_reduce in the stage + eager bias, dropout, residual + send of the whole tensor to the
  peer rank of the next stage (which receives it)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..backends.torch.worker import timed_steps
from ..ir.layout import slice_bounds
from ..launch import rank_device

DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _gen(rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1234 + rank)


def adam_baseline(rank: int, world_size: int, sizes: Mapping[str, int], iters: int, warmup: int) -> list[float]:
    """AllReduce of the gradient + torch.optim.Adam(foreach=True) on the whole replicated tensor."""
    dev = rank_device()
    n = sizes["N"]
    g = torch.randn(n, generator=_gen(rank)).to(dev)
    w = torch.nn.Parameter(torch.randn(n, generator=_gen(0)).to(dev))
    opt = torch.optim.Adam([w], lr=1e-3, foreach=True)
    grad = torch.empty_like(g)

    def step() -> None:
        grad.copy_(g)
        if world_size > 1:
            dist.all_reduce(grad)
            grad.div_(world_size)
        w.grad = grad
        opt.step()

    return timed_steps(step, world_size, dev, iters, warmup)


def model_parallel_baseline(rank: int, world_size: int, sizes: Mapping[str, int], iters: int, warmup: int,
                            dtype: str = "float16", p: float = 0.1) -> list[float]:
    """x_r @ w_r (the rank's slices), AllReduce of the partial sums, then eager dropout(y + b) + r."""
    dev, dt = rank_device(), DTYPE[dtype]
    B, S, H = sizes["B"], sizes["S"], sizes["H"]
    lo, hi = slice_bounds(H, world_size, rank)
    x = torch.randn(B, S, hi - lo, generator=_gen(rank)).to(dev, dt)
    w = torch.randn(hi - lo, H, generator=_gen(rank)).to(dev, dt)
    b = torch.randn(H, generator=_gen(0)).to(dev, dt)
    r = torch.randn(B, S, H, generator=_gen(0)).to(dev, dt)

    def step() -> None:
        y = torch.matmul(x, w)
        if world_size > 1:
            dist.all_reduce(y)
        F.dropout(y + b, p, training=True) + r

    return timed_steps(step, world_size, dev, iters, warmup)


def pipeline_parallel_baseline(rank: int, world_size: int, sizes: Mapping[str, int], iters: int, warmup: int,
                               dtype: str = "float16",
                               p: float = 0.1) -> list[float]:
    """Stage 0 (the first half of the ranks): AllReduce of the partial sums in the stage, eager
    dropout(y + b) + r, then the whole result sent to rank i of stage 1, which receives it."""
    from ..backends.torch.executable import process_groups
    from ..workloads import boundary

    dev, dt = rank_device(), DTYPE[dtype]
    B, S, H = sizes["B"], sizes["S"], sizes["H"]
    half = world_size // 2
    stage_groups = process_groups(boundary(B, S, H, dtype), world_size)  # the groups the schedules use
    group = stage_groups["stage0"]
    buf = torch.empty(B, S, H, dtype=dt, device=dev)
    x = torch.randn(B, S, H, generator=_gen(rank)).to(dev, dt)
    b = torch.randn(H, generator=_gen(0)).to(dev, dt)
    r = torch.randn(B, S, H, generator=_gen(0)).to(dev, dt)

    def step() -> None:
        if rank < half:
            y = x.clone()
            if half > 1:
                dist.all_reduce(y, group=group)
            h = F.dropout(y + b, p, training=True) + r
            dist.send(h, rank + half)
        else:
            dist.recv(buf, rank - half)

    return timed_steps(step, world_size, dev, iters, warmup)


BASELINES: dict[str, Callable[..., list[float]]] = {
    "adam": adam_baseline,
    "model_parallel": model_parallel_baseline,
    "pipeline_parallel": pipeline_parallel_baseline,
}
