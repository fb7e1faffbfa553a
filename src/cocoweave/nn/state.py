"""State dicts of models with tensor-parallel layers that load at another tensor-parallel size (Megatron's
`sharded_state_dict`), or whole in one process.

    state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)}
    checkpoint.save(path, state)                                    # every rank; tp 2, say
    ...                                                             # later, at tp 1 or 4, same model code
    state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)}
    loaded = checkpoint.load(path, state)                           # each rank reads the parts it needs
    model.load_state_dict(unshard(loaded["model"]))
    optimizer.load_state_dict(unshard(loaded["optim"]))

A parameter split across a tensor-parallel group (a ColumnParallelLinear's weight and bias, a RowParallelLinear's
weight) and the optimizer state shaped like it become cocoweave.checkpoint.Shards: this rank's part, the dim and the
whole size, so cocoweave.checkpoint stores each part once and reads back the overlapping parts for any group size.
Everything else is replicated over the group and stored once. `full_state_dict` gathers the whole tensors instead
(torch's `full_state_dict=True`): what a single-process model (ReferenceBlock, nn.Linear) loads, and what
`load_state_dict` of a tensor-parallel model at any size takes directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ParallelConfigError
from .functional import group_size
from .layers import _ParallelLinear


def _sliced(model: nn.Module) -> dict[str, tuple[_ParallelLinear, str, int, int]]:
    """State-dict key -> (layer, parameter name, dim, whole size) of every parameter split across a group."""
    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, _ParallelLinear):
            for pname, (dim, total) in layer.sliced().items():
                out[f"{name}.{pname}" if name else pname] = (layer, pname, dim, total)
    return out


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict()` with every tensor-parallel part as a checkpoint.Shard of it (the same tensors: a
    checkpoint.load into it fills the model in place)."""
    from ..checkpoint import Shard

    sd = model.state_dict()
    for key, (layer, _, dim, total) in _sliced(model).items():
        sd[key] = Shard(sd[key], dim, total, layer.tp_rank, layer.tp_size)
    return sd


def sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with the state of every tensor-parallel part (the tensors shaped like it: Adam's
    moments, fp32 master weights) as checkpoint.Shards. Every parameter of a sliced layer needs its state present
    (cocoweave.optim's optimizers have it from construction; a torch optimizer after its first step)."""
    from ..checkpoint import Shard

    sd = optimizer.state_dict()
    where = {id(getattr(layer, pname)): (key, layer, dim, total)
             for key, (layer, pname, dim, total) in _sliced(model).items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = [k for g in sd["param_groups"] for k in g["params"]]
    for p, k in zip(params, keys, strict=True):
        if id(p) not in where:
            continue
        name, layer, dim, total = where[id(p)]
        entry = sd["state"].get(k)
        if entry is None:
            raise ParallelConfigError(f"the optimizer has no state for {name} yet; take its sharded state dict after "
                                      "a step (torch optimizers create their state in the first step)")
        sd["state"][k] = {s: Shard(t, dim, total, layer.tp_rank, layer.tp_size)
                          if isinstance(t, torch.Tensor) and t.dim() and tuple(t.shape) == tuple(p.shape) else t
                          for s, t in entry.items()}
    return sd


def unshard(tree: Any) -> Any:
    """`tree` with every checkpoint.Shard replaced by its part (a state dict torch's load_state_dict takes)."""
    from ..checkpoint import Shard

    if isinstance(tree, Shard):
        return tree.part
    if isinstance(tree, Mapping):
        return {k: unshard(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(unshard(v) for v in tree)
    return tree


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every tensor-parallel part all-gathered into the whole tensor (a collective of
    each layer's group; every rank gets the whole)."""
    sd = model.state_dict()
    for key, (layer, _, dim, total) in _sliced(model).items():
        sd[key] = _gather(sd[key], dim, total, layer)
    return sd


def _gather(part: torch.Tensor, dim: int, total: int, layer: _ParallelLinear) -> torch.Tensor:
    """The whole tensor from every rank's part along `dim` (torch.tensor_split sizes: padded to the largest)."""
    n = group_size(layer.group)
    if n == 1:
        return part
    size = -(-total // n)
    padded = torch.zeros(*part.shape[:dim], size, *part.shape[dim + 1:], dtype=part.dtype, device=part.device)
    padded.narrow(dim, 0, part.shape[dim]).copy_(part)
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded.contiguous(), group=layer.group)
    q, r = divmod(total, n)
    return torch.cat([p.narrow(dim, 0, q + (i < r)) for i, p in enumerate(parts)], dim)
