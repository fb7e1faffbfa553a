"""Megatron-style tensor-parallel linear layers over a torch.distributed process group.

    col = ColumnParallelLinear(d, 4 * d, group=tp)           # weight rows (output features) sliced
    row = RowParallelLinear(4 * d, d, group=tp, dropout=0.1)   # weight columns (input features) sliced
    y = row(gelu(col(x)), residual=x)                          # = dropout(x W1ᵀ ... W2ᵀ + b2) + x, replicated

Slices follow the DSL's `Sliced` layout (torch.tensor_split sizes, rank r holds part r). `group` is a
ProcessGroup (None: the world) or a DeviceMesh (its "tp" dim, or its only one).

They behave as torch.nn layers do:
- Initialisation: each rank draws only its part of the weight (nn/init.py: tiles from a counter-seeded generator),
  with the values of `full_linear_weights(in, out, bias, seed)`, the whole layer's (nn.Linear's distribution), at
  every tensor-parallel size. `reset_parameters()` draws them again; `device="meta"` then `to_empty()` and
  `reset_parameters()` gives the layer built directly. `from_linear` / `load_full` take a full-size nn.Linear's.
- State dict: this rank's parts under nn.Linear's names. `load_state_dict` also takes the full (unsharded)
  tensors, e.g. a single-process model's state dict, and keeps this rank's part; a checkpoint saved at another
  tensor-parallel size loads through `cocoweave.nn.sharded_state_dict` and cocoweave.checkpoint (nn/state.py).
  RowParallelLinear's dropout counter (seed, dropout_step) is its extra state, so a resumed run draws the same
  masks; a state dict without it (nn.Linear's) leaves the counter as it is.
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
from ..sharding import is_dtensor, local, local_data, places_like_dtensor, replicate_parameter, shard_parameter, tp_mesh
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
from .groups import agree_on_build
from .init import partitioned_uniform_

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without torch.distributed
    DeviceMesh = None  # type: ignore[assignment,misc]


WEIGHT, BIAS = 0, 1  # the generator streams of a layer's weight and bias (nn/init.py)


def full_linear_weights(in_features: int, out_features: int, bias: bool, seed: int
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole weight and bias (CPU, fp32) a layer built from `seed` holds parts of: torch.nn.Linear's
    distribution, uniform(-1/sqrt(in_features), 1/sqrt(in_features)), drawn tile by tile (nn/init.py)."""
    bound = _bound(in_features)
    w = partitioned_uniform_(torch.empty(out_features, in_features), (out_features, in_features), (0, 0), bound,
                             seed, WEIGHT)
    b = partitioned_uniform_(torch.empty(out_features), (out_features,), (0,), bound, seed, BIAS) if bias else None
    return w, b


def _bound(in_features: int) -> float:
    return 1.0 / math.sqrt(in_features) if in_features else 0.0


def resolve_group(group: Any) -> Group:
    """The process group a layer splits over: a ProcessGroup or None (the world) as given, a DeviceMesh's "tp"
    dim (or its only dim)."""
    if DeviceMesh is None or not isinstance(group, DeviceMesh):
        return group
    names = group.mesh_dim_names or ()
    if "tp" in names:
        return group.get_group("tp")
    if group.ndim == 1:
        return group.get_group()
    raise ParallelConfigError(f"a DeviceMesh with dims {list(names)} has no 'tp' dim for the tensor-parallel "
                              "layers; name the tensor-parallel dim 'tp'")


class DropoutCounter:
    """The dropout counter (seed, dropout_step) of a module as its extra state, so that a resumed run draws the
    same masks; a state dict without it (a torch.nn layer's, an older checkpoint's) leaves the counter as it is."""

    seed: int
    dropout_step: int

    def get_extra_state(self) -> dict[str, int]:
        return {"seed": int(self.seed), "dropout_step": int(self.dropout_step)}

    def set_extra_state(self, state: Any) -> None:
        self.seed, self.dropout_step = int(state["seed"]), int(state["dropout_step"])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        state_dict.setdefault(prefix + "_extra_state", self.get_extra_state())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]


class _ParallelLinear(nn.Module):
    """Shared parts: the group, this rank's slice of a dimension, loading from full weights."""

    sliced_dim: int = 0  # the weight dimension split across ranks: 0 = output features, 1 = input features

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group, seed: int,
                 device: Any, dtype: torch.dtype | None) -> None:
        super().__init__()
        mesh = tp_mesh(group)
        group = resolve_group(group)
        self.in_features, self.out_features, self.group, self.init_seed = in_features, out_features, group, seed
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        full = (out_features, in_features)[self.sliced_dim]
        if not places_like_dtensor(full, self.tp_size):
            raise ParallelConfigError(f"{type(self).__name__}: {full} {('output', 'input')[self.sliced_dim]} "
                                      f"features do not split over {self.tp_size} tensor-parallel ranks the way "
                                      "DTensor places parts (torch.chunk); use a multiple of the group size")
        self.start, self.stop = slice_bounds(full, self.tp_size, self.tp_rank)
        shape = [out_features, in_features]
        shape[self.sliced_dim] = self.stop - self.start
        # DTensors on the group's mesh (cocoweave/sharding.py): DCP, clip_grad_norm_ and FSDP2 see the whole layer
        self.weight = shard_parameter(torch.empty(shape, device=device, dtype=dtype), mesh, self.sliced_dim, full)
        self.bias = None
        if bias:
            b = torch.empty(self._bias_size(), device=device, dtype=dtype)
            self.bias = shard_parameter(b, mesh, 0, full) if self.sliced_dim == 0 else replicate_parameter(b, mesh)
        self.reset_parameters()

    def _programs(self, schedule: str | None, sequence_parallel: bool) -> None:
        """The cocoweave programs this layer runs (nn/compiled.py), None for the hand-written path."""
        schedule = check_schedule(schedule, type(self).__name__)
        if sequence_parallel and schedule is None:
            schedule = "auto"  # sequence parallelism is a program schedule
        self.sequence_parallel = bool(sequence_parallel)
        self.programs = Programs(schedule, self.group, self.tp_size, self.tp_rank) if schedule else None
        agree_on_build(self.group, "a tensor-parallel layer", type(self).__name__, in_features=self.in_features,
                       out_features=self.out_features, bias=self.bias is not None, schedule=schedule,
                       sequence_parallel=self.sequence_parallel, dtype=str(self.weight.dtype))

    @property
    def schedule(self) -> str:
        """The schedule each of the layer's programs runs (or 'as written': the hand-written path)."""
        return "as written" if self.programs is None else self.programs.describe()

    def _bias_size(self) -> int:
        return self.stop - self.start if self.sliced_dim == 0 else self.out_features

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw this rank's part of the weight and bias of `full_linear_weights(..., seed)`, and only that part
        (nothing on the meta device)."""
        full = (self.out_features, self.in_features)
        start = (self.start, 0) if self.sliced_dim == 0 else (0, self.start)
        bound = _bound(self.in_features)
        partitioned_uniform_(local_data(self.weight), full, start, bound, self.init_seed, WEIGHT)
        if self.bias is not None:
            partitioned_uniform_(local_data(self.bias), full[:1], start[:1], bound, self.init_seed, BIAS)

    def sliced(self) -> dict[str, tuple[int, int]]:
        """The parameters split across the group: name -> (dim, whole size along it)."""
        out = {"weight": (self.sliced_dim, (self.out_features, self.in_features)[self.sliced_dim])}
        if self.bias is not None and self.sliced_dim == 0:
            out["bias"] = (0, self.out_features)
        return out

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """Take this rank's part of full (unsharded) tensors, of a checkpoint.Shard for this rank, and of DTensors
        (torch.distributed.checkpoint's, at this or another tensor-parallel size)."""
        from ..checkpoint import Shard

        for name in ("weight", "bias"):
            value = state_dict.get(prefix + name)
            if is_dtensor(value):  # the same placements: this rank's part; otherwise the whole tensor, cut below
                param = getattr(self, name)
                same = is_dtensor(param) and tuple(value.placements) == tuple(param.placements) \
                    and value.device_mesh.size() == param.device_mesh.size()
                state_dict[prefix + name] = value.to_local() if same else value.full_tensor()
        for name, (dim, total) in self.sliced().items():
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, Shard):
                if (value.dim, value.total, value.index, value.count) != (dim, total, self.tp_rank, self.tp_size):
                    raise ParallelConfigError(f"{key}: the Shard is part {value.index} of {value.count} along dim "
                                              f"{value.dim}, this rank holds part {self.tp_rank} of {self.tp_size} "
                                              f"along dim {dim}")
                value = state_dict[key] = value.part
            local = local_data(getattr(self, name))
            if not isinstance(value, torch.Tensor) or tuple(value.shape) == tuple(local.shape):
                continue
            whole = list(local.shape)
            whole[dim] = total
            if tuple(value.shape) != tuple(whole):
                raise ParallelConfigError(
                    f"{key} has shape {list(value.shape)}: this rank holds {list(local.shape)} of the whole "
                    f"{whole}; load the whole tensor, or a checkpoint saved at another tensor-parallel size through "
                    "cocoweave.nn.sharded_state_dict")
            state_dict[key] = value.narrow(dim, self.start, self.stop - self.start)
        for name in ("weight", "bias"):  # this rank's part as a DTensor of the parameter's placements
            param, value = getattr(self, name), state_dict.get(prefix + name)
            if is_dtensor(param) and isinstance(value, torch.Tensor) and not is_dtensor(value):
                state_dict[prefix + name] = type(param).from_local(value, param.device_mesh, param.placements,
                                                                   run_check=False)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's part of a full (out_features, in_features) weight and (out_features,) bias."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ParallelConfigError(f"{type(self).__name__}: full weight has shape {list(weight.shape)}, "
                                      f"expected [{self.out_features}, {self.in_features}]")
        local_data(self.weight).copy_(weight.narrow(self.sliced_dim, self.start, self.stop - self.start))
        if self.bias is not None:
            if bias is None:
                raise ParallelConfigError(f"{type(self).__name__} has a bias and none was given")
            local_data(self.bias).copy_(bias[self.start:self.stop] if self.sliced_dim == 0 else bias)

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
                 dtype: torch.dtype | None = None, schedule: str | None = "auto",
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
            y = F.linear(copy_to_parallel(x, self.group), local(self.weight), local(self.bias))
        else:
            if self.sequence_parallel and tokens is None:
                raise ParallelConfigError("ColumnParallelLinear: with sequence_parallel=True, forward needs "
                                          "tokens= (the number of rows of the whole input)")
            y = column_parallel(x, local(self.weight), local(self.bias), self.programs, self.out_features, tokens or 0,
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


class RowParallelLinear(DropoutCounter, _ParallelLinear):
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
                 device: Any = None, dtype: torch.dtype | None = None, schedule: str | None = "auto",
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
        weight, bias = local(self.weight), local(self.bias)
        if x.shape[-1] != weight.shape[1]:
            raise ParallelConfigError(f"RowParallelLinear: input has {x.shape[-1]} features on rank "
                                      f"{self.tp_rank}, its weight part expects {weight.shape[1]}")
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
            return row_parallel(x, weight, bias, residual, p, int(seed), int(index_offset), self.programs,
                                self.in_features, self.sequence_parallel)
        return _RowParallel.apply(x, weight, bias, residual, p, int(seed), int(index_offset),
                                  self.overlap_chunks, self.group)


__all__ = ["ColumnParallelLinear", "DropoutCounter", "RowParallelLinear", "full_linear_weights", "part",
           "resolve_group"]
