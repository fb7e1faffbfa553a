"""Parameters that are DTensors (a tensor-parallel layer's, see sharding.py): the optimizer works on their local
tensors. A DTensor parameter is bucketed, reduced over the optimizer's own (data-parallel) group and updated as its
local tensor; its `.grad` stays a DTensor with the parameter's placements whose local tensor is a bucket view.
Refused: an optimizer group that spans ranks holding different parts of a parameter (its update would mix them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ParallelConfigError
from ..sharding import dtensor_api, is_dtensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of `t` (a parameter, a gradient, a state tensor): a DTensor's local tensor, else `t`."""
    return t._local_tensor if is_dtensor(t) else t


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's gradient of parameter `p` (None when it has none)."""
    return None if p.grad is None else local(p.grad)


def like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (shaped like p's local tensor) as p is held: a DTensor with p's mesh and placements (aliasing `t`), or
    `t` itself for a plain parameter."""
    if not is_dtensor(p) or t.shape != p._local_tensor.shape:
        return t
    return dtensor_api().DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                            run_check=False)


def set_grad(p: torch.Tensor, view: torch.Tensor | None) -> None:
    """Give parameter `p` the gradient `view` (a bucket view of its local shape; None: no gradient)."""
    p.grad = None if view is None else like(p, view)


def set_data(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make `view` (a bucket view of its local shape) the storage of parameter `p`'s local tensor."""
    if is_dtensor(p):
        p._local_tensor = view
    else:
        p.data = view


def shard_dims(p: torch.Tensor) -> list[int]:
    """The mesh dims over which parameter `p`'s ranks hold different parts (Shard or Partial placements)."""
    if not is_dtensor(p):
        return []
    return [i for i, pl in enumerate(p.placements) if pl.is_shard() or pl.is_partial()]


def shard_key(p: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The global ranks of each group over which `p` is split (empty: every rank of its mesh holds all of it).
    Parameters share a bucket only with the same key, so that clipping sums a bucket's squared norm over them."""
    return tuple(tuple(dist.get_process_group_ranks(p.device_mesh.get_group(i))) for i in shard_dims(p))


def shard_groups(p: torch.Tensor) -> list[Any]:
    """The process groups of `shard_key(p)`, in its order."""
    return [p.device_mesh.get_group(i) for i in shard_dims(p)]


def check_placement(owner: str, name: Callable[[], str], p: torch.Tensor, group: Any, rows: bool) -> None:
    """Refuse (ParallelConfigError) a DTensor parameter the optimizer over `group` cannot update correctly: one
    split over ranks that `group` also spans (reducing and broadcasting over them would mix different parts), a
    Partial one (its value is a sum over ranks), and for a row optimizer (LAMB: per-tensor trust ratios) a split
    one. `name()`: how a sentence names p ("parameter 'fc.weight'")."""
    if not is_dtensor(p):
        return
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    for i, pl in enumerate(p.placements):
        if pl.is_partial():
            raise ParallelConfigError(f"{owner}: {name()} is a Partial DTensor over mesh dim "
                                      f"{names[i]!r}; parameters must be Shard or Replicate")
    mine = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    for i in shard_dims(p):
        ranks = dist.get_process_group_ranks(mesh.get_group(i))
        if len(set(ranks) & set(mine)) > 1:
            hint = "; pass process_group=mesh.get_group('dp')" if "dp" in names else \
                "; pass the data-parallel group as process_group="
            raise ParallelConfigError(f"{owner}: {name()} is sharded over mesh dim {names[i]!r} (ranks {ranks}), "
                                      f"which the optimizer's process group (ranks {mine}) spans{hint}")
        if rows and len(ranks) > 1:
            raise ParallelConfigError(f"{owner}: {name()} is sharded over mesh dim {names[i]!r} (ranks {ranks}); "
                                      "LAMB's per-tensor trust ratio needs the whole tensor's norm, which is not "
                                      "supported yet: use DistributedAdamW or replicate the parameter")
