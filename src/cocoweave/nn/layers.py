"""Megatron-style tensor-parallel linear layers over a torch.distributed process group.

    col = ColumnParallelLinear(d, 4 * d, group=tp)           # weight rows (output features) sliced
    row = RowParallelLinear(4 * d, d, group=tp, dropout=0.1)   # weight columns (input features) sliced
    y = row(gelu(col(x)), residual=x)                          # = dropout(x W1ᵀ ... W2ᵀ + b2) + x, replicated

Slices follow the DSL's `Sliced` layout (torch.tensor_split sizes, rank r holds part r). Both layers build
their full weight deterministically from `seed` (every rank draws the same one) and keep their part, or
take it from a full-size `torch.nn.Linear` (`from_linear`), so a single-process model holding the full
weights computes the same thing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ParallelConfigError
from ..ir.layout import slice_bounds
from .compiled import Programs, check_schedule
from .functional import (
    Group,
    column_parallel,
    copy_to_parallel,
    epilogue_forward,
    epilogue_grad,
    gather_from_parallel,
    group_rank,
    group_size,
    mix_seed,
    part,
    row_parallel,
    scatter_to_parallel,
)


def full_linear_weights(in_features: int, out_features: int, bias: bool, seed: int
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch.nn.Linear's default initialisation of the full weight and bias, drawn from `seed` (CPU, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
    w = torch.empty(out_features, in_features).uniform_(-bound, bound, generator=gen)
    b = torch.empty(out_features).uniform_(-bound, bound, generator=gen) if bias else None
    return w, b


class _ParallelLinear(nn.Module):
    """Shared parts: the group, this rank's slice of a dimension, loading from full weights."""

    sliced_dim: int = 0  # the weight dimension split across ranks: 0 = output features, 1 = input features

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group, seed: int,
                 device: Any, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        full = (out_features, in_features)[self.sliced_dim]
        if full < self.tp_size:
            raise ParallelConfigError(f"{type(self).__name__}: {full} features cannot be split over "
                                      f"{self.tp_size} ranks")
        self.start, self.stop = slice_bounds(full, self.tp_size, self.tp_rank)
        shape = [out_features, in_features]
        shape[self.sliced_dim] = self.stop - self.start
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self._bias_size(), device=device, dtype=dtype)) if bias else None
        self.load_full(*full_linear_weights(in_features, out_features, bias, seed))

    def _programs(self, schedule: str | None, sequence_parallel: bool) -> None:
        """The cocoweave programs this layer runs (nn/compiled.py), None for the hand-written path."""
        schedule = check_schedule(schedule, type(self).__name__)
        if sequence_parallel and schedule is None:
            schedule = "auto"  # sequence parallelism is a program schedule
        self.sequence_parallel = bool(sequence_parallel)
        self.programs = Programs(schedule, self.group, self.tp_size, self.tp_rank) if schedule else None

    @property
    def schedule(self) -> str:
        """The schedule each of the layer's programs runs (or 'as written': the hand-written path)."""
        return "as written" if self.programs is None else self.programs.describe()

    def _bias_size(self) -> int:
        return self.stop - self.start if self.sliced_dim == 0 else self.out_features

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's part of a full (out_features, in_features) weight and (out_features,) bias."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ParallelConfigError(f"{type(self).__name__}: full weight has shape {list(weight.shape)}, "
                                      f"expected [{self.out_features}, {self.in_features}]")
        self.weight.copy_(weight.narrow(self.sliced_dim, self.start, self.stop - self.start))
        if self.bias is not None:
            if bias is None:
                raise ParallelConfigError(f"{type(self).__name__} has a bias and none was given")
            self.bias.copy_(bias[self.start:self.stop] if self.sliced_dim == 0 else bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group = None, **kwargs: Any) -> _ParallelLinear:
        """This layer holding this rank's part of a full-size `linear`'s weight and bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        layer.load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"part={self.tp_rank}/{self.tp_size} [{self.start}:{self.stop}], schedule={self.schedule}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class ColumnParallelLinear(_ParallelLinear):
    """y = x Wᵀ + b with W's rows (output features) split across `group`: input replicated, output sliced
    on the last dim (or all-gathered with `gather_output`). The backward sums the input gradient (f)."""

    sliced_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: Group = None,
                 gather_output: bool = False, seed: int = 0, device: Any = None,
                 dtype: torch.dtype | None = None, schedule: str | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__(in_features, out_features, bias, group, seed, device, dtype)
        if gather_output and out_features % self.tp_size:
            raise ParallelConfigError(f"ColumnParallelLinear: gather_output needs out_features ({out_features}) "
                                      f"divisible by the group size ({self.tp_size})")
        self.gather_output = gather_output
        self._programs(schedule, sequence_parallel)

    def forward(self, x: torch.Tensor, *, tokens: int | None = None) -> torch.Tensor:
        """x Wᵀ + b. With sequence parallelism x is this rank's slice of the (tokens, in_features) input
        (torch.tensor_split rows) and `tokens` the whole count; the output is every token's slice of features."""
        if self.programs is None:
            y = F.linear(copy_to_parallel(x, self.group), self.weight, self.bias)
        else:
            if self.sequence_parallel and tokens is None:
                raise ParallelConfigError("ColumnParallelLinear: with sequence_parallel=True, forward needs "
                                          "tokens= (the number of rows of the whole input)")
            y = column_parallel(x, self.weight, self.bias, self.programs, self.out_features, tokens or 0,
                                self.sequence_parallel)
        return gather_from_parallel(y, -1, self.group) if self.gather_output else y


class _RowParallel(torch.autograd.Function):
    """x_r W_rᵀ, all-reduced, then dropout(. + b) + residual; in `chunks` row chunks whose all-reduce runs
    asynchronously while the next chunk multiplies and the previous chunk's epilogue runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None, p: float, seed: int, offset: int, chunks: int,
                group: Group) -> torch.Tensor:
        out_f = weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        r2 = None if residual is None else residual.reshape(rows, out_f)
        parallel = group_size(group) > 1
        pending = []
        n = min(chunks, rows) or 1
        for c in range(n):
            a, b = slice_bounds(rows, n, c)
            y = x2[a:b] @ weight.t()
            pending.append((a, b, y, dist.all_reduce(y, group=group, async_op=True) if parallel else None))
        out = torch.empty(rows, out_f, dtype=x.dtype, device=x.device)
        for a, b, y, work in pending:
            if work is not None:
                work.wait()
            out[a:b] = epilogue_forward(y, bias, None if r2 is None else r2[a:b], p, seed, offset + a * out_f)
        ctx.save_for_backward(x, weight)
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        return out.reshape(*x.shape[:-1], out_f)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, weight.shape[0])
        gy = epilogue_grad(g2, ctx.p, ctx.seed, ctx.offset)  # the all-reduce's gradient is the identity (g)
        gx = (gy @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = gy.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gr = grad if ctx.has_residual else None
        return gx, gw, gb, gr, None, None, None, None, None


class RowParallelLinear(_ParallelLinear):
    """out = dropout(x Wᵀ + b, p) + residual with W's columns (input features) split across `group`:
    the input is sliced on its last dim (or sliced here if `input_is_parallel=False`), the partial products
    are all-reduced (g) and the fused epilogue runs on the replicated sum. `overlap_chunks > 1` splits the
    rows into chunks so each chunk's all-reduce overlaps the next chunk's matmul and the epilogue.

    Dropout uses cocoweave's counter-based mask: element i of the output is at logical index
    `index_offset + i` and its mask depends only on (seed, that index), so forward and backward agree
    and a single-process model with the same seed draws the same mask. Each training forward needs a fresh
    mask: pass `dropout_seed` (e.g. from the training step, which makes a resumed run draw the same masks), or
    leave it None and the layer uses mix_seed(seed, dropout_step) and advances `dropout_step`."""

    sliced_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: Group = None,
                 input_is_parallel: bool = True, dropout: float = 0.0, overlap_chunks: int = 1, seed: int = 0,
                 device: Any = None, dtype: torch.dtype | None = None, schedule: str | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__(in_features, out_features, bias, group, seed, device, dtype)
        if not 0.0 <= dropout < 1.0:
            raise ParallelConfigError(f"RowParallelLinear: dropout must be in [0, 1), got {dropout}")
        if overlap_chunks < 1:
            raise ParallelConfigError(f"RowParallelLinear: overlap_chunks must be >= 1, got {overlap_chunks}")
        if not input_is_parallel and in_features % self.tp_size:
            raise ParallelConfigError(f"RowParallelLinear: slicing the input here needs in_features "
                                      f"({in_features}) divisible by the group size ({self.tp_size})")
        self.input_is_parallel, self.p, self.overlap_chunks = input_is_parallel, dropout, overlap_chunks
        self.seed = seed
        self.dropout_step = 0  # training forwards without a dropout_seed so far: the next one's mask
        self._programs(schedule, sequence_parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, dropout_seed: int | None = None,
                index_offset: int = 0) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, -1, self.group)
        if x.shape[-1] != self.weight.shape[1]:
            raise ParallelConfigError(f"RowParallelLinear: input has {x.shape[-1]} features on rank "
                                      f"{self.tp_rank}, its weight part expects {self.weight.shape[1]}")
        want = (*x.shape[:-1], self.out_features)
        if self.sequence_parallel and residual is not None:
            want = (self.programs.part_rows(x.reshape(-1, x.shape[-1]).shape[0]), self.out_features)
        if residual is not None and tuple(residual.shape) != tuple(want):
            raise ParallelConfigError(f"RowParallelLinear: residual has shape {list(residual.shape)}, expected "
                                      f"{list(want)}")
        p = self.p if self.training else 0.0
        seed = dropout_seed
        if seed is None:
            seed = mix_seed(self.seed, self.dropout_step)
            self.dropout_step += p > 0  # a fresh mask for the next training forward
        if self.programs is not None:
            return row_parallel(x, self.weight, self.bias, residual, p, int(seed), int(index_offset), self.programs,
                                self.in_features, self.sequence_parallel)
        return _RowParallel.apply(x, self.weight, self.bias, residual, p, int(seed), int(index_offset),
                                  self.overlap_chunks, self.group)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "full_linear_weights", "part"]
