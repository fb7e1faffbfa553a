"""The MoE layer's experts: a stack of SwiGLU experts of which this rank holds a block (`GroupedExperts`, its
parameters DTensors Shard(0) over the ep mesh, each expert drawn from its own generator), and the optional shared
expert.

The grouped computation is a loop over the local experts, one GEMM per expert and matrix on its contiguous rows,
through autograd; the stacked weights are unbound once (indexing w[e] per expert made backward zero-fill a
full-size gradient per expert: 2.7x slower). Measured on the 2-vCPU machine (shared, load 4-5), 1 thread, fwd+bwd of 4
experts of dim 256 x hidden 896 over 1024 rows and of 8 experts of 256 x 224 over 2048 rows: this loop 42 and 21 ms;
Megatron's SequentialMLP form (gate and up fused in one Linear) 42 and 21 ms; one autograd function writing every
GEMM into slices of whole buffers (mm(out=), two saved activations instead of four) 51 and 25 ms; a padded bmm
as fast with even loads and 2-3x slower with skewed ones; torch._grouped_mm (torch 2.13) has no float32 backward on
the CPU (its bfloat16 one is 4x faster than float32 here: torchtitan's experts run in bfloat16).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParallelConfigError
from ..sharding import is_dtensor, local, local_data, shard_parameter
from .functional import mix_seed

_W1, _W2, _W3 = 1, 2, 3  # init streams


def uniform(shape: tuple[int, ...], bound: float, seed: int) -> torch.Tensor:
    """uniform(-bound, bound) values of `shape` from a generator of its own seeded by `seed`."""
    return torch.empty(shape).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.scale, None


class GroupedExperts(nn.Module):
    """This rank's experts of a stack of `n_experts` SwiGLU experts, w2(silu(x w1) * x w3) each."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, *, mesh: Any, rank: int, ranks: int, seed: int,
                 grad_divisor: float = 1.0) -> None:
        super().__init__()
        self.n_experts, self.n_local = n_experts, n_experts // ranks
        self.first = rank * self.n_local
        self.grad_divisor = grad_divisor
        local_ids = range(self.first, self.first + self.n_local)
        shapes = {_W1: (dim, hidden_dim), _W2: (hidden_dim, dim), _W3: (dim, hidden_dim)}
        for name, stream in (("w1", _W1), ("w2", _W2), ("w3", _W3)):
            shape = shapes[stream]
            bound = shape[0] ** -0.5  # nn.Linear's default bound, 1/sqrt(fan_in)
            part = torch.stack([uniform(shape, bound, mix_seed(seed, stream, e)) for e in local_ids]) \
                if self.n_local else torch.empty(0, *shape)
            setattr(self, name, shard_parameter(part, mesh, 0, n_experts) if mesh is not None else nn.Parameter(part))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """Take this rank's experts of whole (E, ...) tensors (a single-process layer's), of a checkpoint.Shard of
        this rank's, and of DTensors at this or another ep degree."""
        from ..checkpoint import Shard

        for name in ("w1", "w2", "w3"):
            key, param = prefix + name, getattr(self, name)
            value = state_dict.get(key)
            if isinstance(value, Shard):
                value = value.part
            if is_dtensor(value):
                same = is_dtensor(param) and tuple(value.placements) == tuple(param.placements) \
                    and value.device_mesh.size() == param.device_mesh.size()
                value = value.to_local() if same else value.full_tensor()
            if not isinstance(value, torch.Tensor):
                continue
            part = local_data(param)
            if tuple(value.shape) == (self.n_experts, *part.shape[1:]) and part.shape[0] != self.n_experts:
                value = value.narrow(0, self.first, self.n_local)
            elif tuple(value.shape) != tuple(part.shape):
                raise ParallelConfigError(f"{key} has shape {list(value.shape)}: expected the whole "
                                          f"{[self.n_experts, *part.shape[1:]]} or this rank's "
                                          f"{list(part.shape)}")
            state_dict[key] = type(param).from_local(value, param.device_mesh, param.placements, run_check=False) \
                if is_dtensor(param) else value
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3): this rank's experts' tensors (differentiable), their gradients divided by grad_divisor."""
        ws = tuple(local(w) for w in (self.w1, self.w2, self.w3))
        if self.grad_divisor != 1:
            ws = tuple(_ScaleGrad.apply(w, 1.0 / self.grad_divisor) for w in ws)
        return ws  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows grouped by local expert, counts[e] rows for local expert e; the experts' outputs, same order.
        One GEMM per expert and matrix, through autograd (see the module for what else was measured)."""
        w1, w2, w3 = (w.unbind(0) for w in self.weights())  # unbind: one gradient stack, not E zero-filled ones
        outs = [(F.silu(xs @ w1[e]) * (xs @ w3[e])) @ w2[e] for e, xs in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x[:0]


class SharedExpert(nn.Module):
    """A dense SwiGLU every token goes through (DeepSeek's shared expert), torchtitan's names w1, w2, w3."""

    def __init__(self, dim: int, hidden_dim: int, seed: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        with torch.no_grad():
            for i, lin in enumerate((self.w1, self.w2, self.w3)):
                lin.weight.copy_(uniform(tuple(lin.weight.shape), lin.in_features ** -0.5, mix_seed(seed, i)))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """silu(w1 x) * w3 x: the first part (2/3 of the FLOPs), run by MoE while its dispatch is in flight."""
        return F.silu(self.w1(x)) * self.w3(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.hidden(x))


__all__ = ["GroupedExperts", "SharedExpert", "uniform"]
