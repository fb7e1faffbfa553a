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

Parts are torch.chunk-sized (DTensor's rule): a sharded dimension the group size divides, or an uneven one whose
torch.chunk parts equal cocoweave's torch.tensor_split parts (7 over 2); layers refuse any other with a sentence.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without torch.distributed
    DeviceMesh = None  # type: ignore[assignment,misc]


def dtensor_api() -> Any:
    """torch.distributed.tensor (DTensor, Shard, Replicate), imported on first use: it costs about 0.4 s, and a
    process with no tensor-parallel group never needs it."""
    import torch.distributed.tensor as api

    return api


_MESHES: dict[tuple[int, str, str], Any] = {}


def tp_mesh(group: Any, dim: str = "tp") -> DeviceMesh | None:
    """The 1-D DeviceMesh of a layer's group: a DeviceMesh's `dim` dim ("tp", or "ep" for the experts; its only dim
    when it has one), a ProcessGroup's mesh (None: the world), built once per group; None when torch.distributed is
    not initialised."""
    if DeviceMesh is not None and isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        return group[dim] if dim in names and group.ndim > 1 else group
    if not dist.is_available() or not dist.is_initialized():
        return None
    pg = dist.group.WORLD if group is None else group
    device_type = "cuda" if "nccl" in str(dist.get_backend(pg)).lower() else "cpu"
    key = (id(pg), device_type, dim)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(pg, device_type, mesh_dim_names=(dim,))
    return _MESHES[key]


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (a parameter of a tensor-parallel layer built on a process group)."""
    api = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before the module is imported
    return api is not None and isinstance(t, api.DTensor)


def places_like_dtensor(size: int, parts: int) -> bool:
    """Whether `size` rows split in `parts` the way cocoweave splits (torch.tensor_split) land where DTensor puts
    them (torch.chunk): always when `parts` divides `size`, and for some uneven sizes (7 over 2: 4 and 3)."""
    chunk = -(-size // parts)
    return all(min(chunk, max(0, size - i * chunk)) == size // parts + (i < size % parts) for i in range(parts))


def shard_parameter(local_part: torch.Tensor, mesh: DeviceMesh | None, dim: int, total: int | None = None
                    ) -> nn.Parameter:
    """`local_part` (this rank's chunk along `dim`) as a parameter: a DTensor Shard(dim) on `mesh` whose whole size
    along `dim` is `total` (None: the part's size times the mesh's), or the plain tensor without a mesh (one
    process)."""
    if mesh is None:
        return nn.Parameter(local_part)
    api = dtensor_api()
    shape = list(local_part.shape)
    shape[dim] = shape[dim] * mesh.size() if total is None else total
    stride = torch.empty(shape, device="meta").stride()  # contiguous, as the part is
    return nn.Parameter(api.DTensor.from_local(local_part, mesh, [api.Shard(dim)], run_check=False,
                                               shape=torch.Size(shape), stride=stride))


def replicate_parameter(whole: torch.Tensor, mesh: DeviceMesh | None) -> nn.Parameter:
    """`whole` (the same on every rank of the mesh) as a parameter: a DTensor Replicate() on `mesh`, or the plain
    tensor without a mesh."""
    if mesh is None:
        return nn.Parameter(whole)
    api = dtensor_api()
    return nn.Parameter(api.DTensor.from_local(whole, mesh, [api.Replicate()], run_check=False))


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's tensor of a parameter: `to_local()` of a DTensor (differentiable), the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def local_data(t: torch.Tensor) -> torch.Tensor:
    """The storage of this rank's tensor, for in-place initialisation and copies (no autograd)."""
    return t._local_tensor if is_dtensor(t) else t.data


def replicate_parameters(module: nn.Module, mesh: DeviceMesh | None) -> nn.Module:
    """Make `module`'s own parameters Replicate() DTensors on `mesh` (names and requires_grad kept), and let its
    `load_state_dict` take plain tensors (a single-process model's) as well as DTensors; returns `module`. Its forward
    must then use `local(p)` (cocoweave's layers do; `parallelize` wraps other modules)."""
    if mesh is None:
        return module
    for name, p in list(module.named_parameters(recurse=False)):
        if not is_dtensor(p):
            new = replicate_parameter(p.detach(), mesh)
            new.requires_grad_(p.requires_grad)
            setattr(module, name, new)
    module._register_load_state_dict_pre_hook(_as_own_placements, with_module=True)
    return module


def _as_own_placements(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: a value for a DTensor parameter becomes a DTensor of the parameter's own mesh and
    placements (a plain tensor is taken as this rank's tensor, a DTensor of other placements is gathered first)."""
    for name, p in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if not is_dtensor(p) or not isinstance(value, torch.Tensor):
            continue
        if is_dtensor(value):
            if tuple(value.placements) == tuple(p.placements) and value.device_mesh.size() == p.device_mesh.size():
                continue
            value = value.full_tensor()
        state_dict[prefix + name] = dtensor_api().DTensor.from_local(value, p.device_mesh, p.placements,
                                                                     run_check=False)


__all__ = ["dtensor_api", "is_dtensor", "local", "local_data", "places_like_dtensor", "replicate_parameter",
           "replicate_parameters", "shard_parameter", "tp_mesh"]
