"""Parameters of tensor-parallel layers as DTensors on the tensor-parallel dim of a DeviceMesh.

A layer keeps each parameter as an `nn.Parameter` holding a DTensor: `Shard(dim)` where every rank holds one part
(a ColumnParallelLinear's weight rows), `Replicate()` where every rank holds the whole tensor (a norm's weight).
torch's own tools then see the whole model: `torch.distributed.checkpoint` saves each part once under the whole
tensor's name and reshards on load, `clip_grad_norm_` sums the parts' squared norms over the group, FSDP2 composes
over another mesh dim. The compiled programs run on the local tensors (`local(p)`, differentiable: the gradient
comes back as a DTensor with the parameter's placements).

    mesh = tp_mesh(group)                      # 1-D mesh of the layer's group (None: no process group)
    w = shard_parameter(torch.empty(out // tp, d), mesh, 0)
    y = x @ local(w).t()

Parts are torch.chunk-sized (DTensor's rule), so a sharded dimension must divide the group size evenly; layers
refuse an uneven one with a sentence (Megatron and torchtitan require the same).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without torch.distributed
    DeviceMesh = DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]

_MESHES: dict[tuple[int, str], Any] = {}


def tp_mesh(group: Any) -> DeviceMesh | None:
    """The 1-D DeviceMesh of a tensor-parallel group: a DeviceMesh's "tp" dim (or its only dim), a ProcessGroup's
    mesh (None: the world), built once per group; None when torch.distributed is not initialised."""
    if DeviceMesh is not None and isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        return group["tp"] if "tp" in names and group.ndim > 1 else group
    if not dist.is_available() or not dist.is_initialized():
        return None
    pg = dist.group.WORLD if group is None else group
    device_type = "cuda" if "nccl" in str(dist.get_backend(pg)).lower() else "cpu"
    key = (id(pg), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(pg, device_type, mesh_dim_names=("tp",))
    return _MESHES[key]


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (a parameter of a tensor-parallel layer built on a process group)."""
    return DTensor is not None and isinstance(t, DTensor)


def shard_parameter(local_part: torch.Tensor, mesh: DeviceMesh | None, dim: int) -> nn.Parameter:
    """`local_part` (this rank's chunk along `dim`) as a parameter: a DTensor Shard(dim) on `mesh`, or the plain
    tensor without a mesh (one process)."""
    if mesh is None:
        return nn.Parameter(local_part)
    return nn.Parameter(DTensor.from_local(local_part, mesh, [Shard(dim)], run_check=False))


def replicate_parameter(whole: torch.Tensor, mesh: DeviceMesh | None) -> nn.Parameter:
    """`whole` (the same on every rank of the mesh) as a parameter: a DTensor Replicate() on `mesh`, or the plain
    tensor without a mesh."""
    if mesh is None:
        return nn.Parameter(whole)
    return nn.Parameter(DTensor.from_local(whole, mesh, [Replicate()], run_check=False))


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's tensor of a parameter: `to_local()` of a DTensor (differentiable), the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def local_data(t: torch.Tensor) -> torch.Tensor:
    """The storage of this rank's tensor, for in-place initialisation and copies (no autograd)."""
    return t._local_tensor if is_dtensor(t) else t.data


__all__ = ["is_dtensor", "local", "local_data", "replicate_parameter", "shard_parameter", "tp_mesh"]
