"""Sequence parallelism for `parallelize`: activations outside attention and the feed-forward network live as this
rank's slice of the sequence (dim 1 of [batch, sequence, features], torch's Shard(1)), as torchtitan's and
Megatron's sequence parallelism keep them (Korthikanti et al. 2022).

The communication is DTensor's: the slice is all-gathered once where a module needs the whole sequence (torch's
PrepareModuleInput, or a ColwiseParallel with Shard(1) input), and a row-parallel projection's partial sums are
reduce-scattered straight into the next slice (RowwiseParallel with Shard(1) output). The column-parallel
projections between them communicate nothing: their input gradients stay partial sums until the gather's backward
reduce-scatters them, once for all of a module's projections (wq, wk and wv together). A module that runs on the
slice (SequenceParallel: the norms) sees only its rank's tokens, so the gradients of its replicated parameters are
summed over the group.

All of it is autograd functions over torch.distributed, checked against one process forward and backward in
tests/nn/test_sequence_parallel.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import ParallelConfigError
from ..sharding import is_dtensor, local, replicate_parameters
from .functional import (
    Group,
    all_gather_cat,
    copy_to_parallel,
    gather_from_parallel,
    group_size,
    scatter_to_parallel,
)
from .layers import ColumnParallelLinear, RowParallelLinear

SEQ = 1  # the sequence dimension of [batch, sequence, features] (torchtitan's Shard(1))
# torch 2.13 renamed the tensor collectives; older releases (the GPU machine's 2.11) have the old names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check(x: torch.Tensor, who: str) -> None:
    if x.dim() < 2:
        raise ParallelConfigError(f"{who}: sequence parallelism needs [batch, sequence, ...] activations, got shape "
                                  f"{list(x.shape)}")


def _reduce_scatter(x: torch.Tensor, group: Group, who: str) -> torch.Tensor:
    """The sum over the group of `x`, this rank's slice of the sequence of it."""
    n = group_size(group)
    if x.shape[SEQ] % n:
        raise ParallelConfigError(f"{who}: a sequence of {x.shape[SEQ]} tokens does not split over {n} "
                                  "tensor-parallel ranks; use a sequence length the group size divides")
    stacked = x.unflatten(SEQ, (n, x.shape[SEQ] // n)).movedim(SEQ, 0).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    _REDUCE_SCATTER(out, stacked.flatten(0, 1), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the sequence. Backward: the partial gradients of the whole sequence summed and
    scattered (one reduce-scatter for every column-parallel projection that read the gathered input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_cat(x, SEQ, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.group, "sequence parallelism"), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: partial sums reduce-scattered into this rank's sequence slice. Backward: the slices' gradients
    all-gathered (each rank's partial product needs the whole sequence's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group, "sequence parallelism")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_cat(grad, SEQ, ctx.group), None


def gather_sequence(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """This rank's slice of the sequence (dim 1) -> the whole sequence; the backward reduce-scatters."""
    _check(x, "gather_sequence")
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Partial sums of the whole sequence -> this rank's slice of their sum; the backward all-gathers."""
    _check(x, "reduce_scatter_sequence")
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group)


class SequenceColumnLinear(ColumnParallelLinear):
    """A column-parallel projection between a sequence gather and a row-parallel projection: x Wᵀ + b on the whole
    sequence with this rank's output features, no communication (the gather's backward sums the input gradient).
    With `gather_input` it gathers its own input first (torch's ColwiseParallel(input_layouts=Shard(1)))."""

    def __init__(self, *args: Any, gather_input: bool = False, **kwargs: Any) -> None:
        kwargs["schedule"] = None  # torch ops around the sequence collectives, not a layer program
        super().__init__(*args, **kwargs)
        self.gather_input = gather_input

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:  # noqa: D102 - the class says it
        if self.gather_input:
            x = gather_sequence(x, self.group)
        y = F.linear(x, local(self.weight), local(self.bias))
        return gather_from_parallel(y, -1, self.group) if self.gather_output else y


class SequenceRowLinear(RowParallelLinear):
    """A row-parallel projection whose output is this rank's slice of the sequence: x Wᵀ on this rank's input
    features, the partial sums reduce-scattered along the sequence, then the (replicated) bias."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["schedule"] = None
        super().__init__(*args, **kwargs)
        if self.p:
            raise ParallelConfigError("SequenceRowLinear: dropout is not supported with sequence parallelism here")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, **_: Any) -> torch.Tensor:  # noqa: D102
        if not self.input_is_parallel:  # a whole input: this rank's features of it
            x = scatter_to_parallel(x, -1, self.group)
        y = reduce_scatter_sequence(F.linear(x, local(self.weight)), self.group)
        if self.bias is not None:
            y = y + copy_to_parallel(local(self.bias), self.group)  # each rank saw only its tokens' gradient
        return y if residual is None else y + residual


def on_sequence_slices(module: torch.nn.Module, mesh: Any, group: Group) -> None:
    """Run `module` (a norm: torch's SequenceParallel) on this rank's sequence slice: its parameters become
    replicated DTensors on `mesh` and its forward sees their local tensors, whose gradients are summed over `group`
    (each rank saw only its own tokens)."""
    replicate_parameters(module, mesh)
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        saved = {name: p for name, p in module._parameters.items() if p is not None}
        try:
            for name, p in saved.items():
                module._parameters[name] = copy_to_parallel(p.to_local() if is_dtensor(p) else p, group)
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


def gather_inputs(module: torch.nn.Module, positions: Sequence[int], names: Sequence[str], group: Group) -> None:
    """All-gather the sequence of `module`'s positional inputs at `positions` and keyword inputs `names` before its
    forward (torch's PrepareModuleInput from Shard(1) to Replicate())."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args = tuple(gather_sequence(a, group) if i in positions and torch.is_tensor(a) else a
                     for i, a in enumerate(args))
        kwargs = {k: gather_sequence(v, group) if k in names and torch.is_tensor(v) else v for k, v in kwargs.items()}
        return inner(*args, **kwargs)

    module.forward = forward


def scatter_output(module: torch.nn.Module, group: Group) -> None:
    """Keep this rank's slice of the sequence of `module`'s replicated output (an embedding's, before sequence-
    parallel blocks); the backward all-gathers the slices' gradients."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if out.shape[SEQ] % group_size(group):
            raise ParallelConfigError(f"{type(module).__name__}: a sequence of {out.shape[SEQ]} tokens does not "
                                      f"split over {group_size(group)} tensor-parallel ranks; use a sequence length "
                                      "the group size divides")
        return scatter_to_parallel(out, SEQ, group)

    module.forward = forward


__all__ = ["SequenceColumnLinear", "SequenceRowLinear", "gather_inputs", "gather_sequence", "on_sequence_slices",
           "reduce_scatter_sequence", "scatter_output"]
