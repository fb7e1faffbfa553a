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
weight) is a DTensor, and so is torch's optimizer state for it; cocoweave.checkpoint stores a DTensor as this rank's
part with its dim and whole size (a checkpoint.Shard), each part once, and reads back the overlapping parts for any
group size, into the DTensor in place. Plain optimizer state shaped like a part becomes a checkpoint.Shard. Everything
else is replicated over the group and stored once. `full_state_dict` gathers the whole tensors instead
(torch's `full_state_dict=True`): what a single-process model (ReferenceBlock, nn.Linear) loads, and what
`load_state_dict` of a tensor-parallel model at any size takes directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ParallelConfigError
from ..sharding import is_dtensor, local_data


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict()` for cocoweave.checkpoint: a tensor-parallel part is a DTensor, which the checkpoint
    stores as its part and a load fills in place (through its local tensor), at any tensor-parallel size."""
    return dict(model.state_dict())


def sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` for cocoweave.checkpoint: state held as DTensors (torch's optimizers over DTensor
    parameters) stays as it is; plain state tensors shaped like a sharded parameter's part become checkpoint.Shards
    like the parameter's. Every sharded parameter needs its state present (cocoweave.optim's optimizers have it from
    construction; a torch optimizer after its first step)."""
    sd = optimizer.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = [k for g in sd["param_groups"] for k in g["params"]]
    for p, k in zip(params, keys, strict=True):
        if not is_dtensor(p) or not any(pl.is_shard() for pl in p.placements):
            continue
        entry = sd["state"].get(k)
        if entry is None:
            raise ParallelConfigError(f"the optimizer has no state for {names.get(id(p), k)} yet; take its sharded "
                                      "state dict after a step (torch optimizers create their state in the first "
                                      "step), or save optimizer.state_dict() with torch.distributed.checkpoint")
        sd["state"][k] = {s: _state_shard(t, p) for s, t in entry.items()}
    return sd


def _state_shard(t: Any, p: torch.Tensor) -> Any:
    """A plain optimizer state tensor shaped like sharded parameter `p`'s part as a checkpoint.Shard like `p`'s."""
    from ..checkpoint import Shard, as_shard

    if not is_dtensor(t) and isinstance(t, torch.Tensor) and t.dim() and tuple(t.shape) == tuple(local_data(p).shape):
        shard = as_shard(p.detach())
        return Shard(t, shard.dim, shard.total, shard.index, shard.count, shard.shares)
    return t


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
    return {k: v.full_tensor() if is_dtensor(v) else v for k, v in model.state_dict().items()}
