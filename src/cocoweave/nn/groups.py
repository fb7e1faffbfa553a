"""Process groups of a data x pipeline x tensor parallel layout, as a torch DeviceMesh in Megatron's order
(tensor-parallel ranks adjacent, then pipeline stages, then data-parallel replicas).

    mesh = parallel_mesh(tensor_parallel=2, pipeline_parallel=2)   # world 8: dims ("dp", "pp", "tp") = (2, 2, 2)
    tp, pp, dp = (mesh.get_group(d) for d in ("tp", "pp", "dp"))   # rank r = (dp * pp_size + pp) * tp_size + tp
    tp_group, dp_group = parallel_groups(tensor_parallel=2)        # world 4: tp {0,1} {2,3}, dp {0,2} {1,3}

Every group made here carries the job's timeout (`init_from_env(timeout_s=...)`, `init_process_group(timeout=...)`,
read back from the default group), not torch's default of 30 minutes for new groups: a rank that stops answering
makes the others give up in about that time.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import BackendError, ParallelConfigError
from ..group_facts import agree, group_size


def agree_on_build(group: Any, what: str, name: str, **config: Any) -> None:
    """Refuse, on every rank of `group` at once, `what` (a layer, a pipeline) its ranks build differently (another
    shape, schedule, dtype or micro-batch count on one rank): one small all-gather at construction, before its first
    collective, instead of a hang or an abort inside torch at the first step. The executables' own check
(group_facts.agree), on the configuration."""
    if group_size(group) == 1 or not dist.is_initialized():
        return
    text = ", ".join(f"{k}={v!r}" for k, v in config.items())
    try:
        agree(f"{name}({text})", f"{what} (build the same layers and pipelines, in the same order, with the same "
              "shapes, schedule=, micro-batches and dtype on every rank of the group)", group=group, parts=config)
    except BackendError as exc:
        raise ParallelConfigError(str(exc)) from None

MESH_DIMS = ("dp", "pp", "tp")
_CACHE: dict[tuple[int, ...], Any] = {}
_MESHES: dict[tuple[Any, ...], DeviceMesh] = {}


def job_timeout() -> timedelta | None:
    """The default process group's timeout (what the job was started with), or None when torch does not say."""
    world = dist.group.WORLD
    for device in [torch.device("cpu"), *getattr(world, "_device_types", [])]:
        try:
            timeout = world._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def inherit_timeout(group: Any) -> Any:
    """`group`, its timeout set to the job's (`job_timeout`); the default group and None are left as they are."""
    timeout = job_timeout()
    if group is not None and group is not dist.group.WORLD and timeout is not None:
        group.set_timeout(timeout)
    return group


def new_group(ranks: list[int]) -> Any:
    """A process group of `ranks` with the job's timeout, created once per process (every rank must ask for the
    same groups in order)."""
    key = tuple(ranks)
    if key not in _CACHE:
        _CACHE[key] = dist.new_group(list(ranks), timeout=job_timeout())
    return _CACHE[key]


def mesh_shape(world_size: int, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> tuple[int, int, int]:
    """(dp, pp, tp) sizes of a world of `world_size` ranks, or ParallelConfigError saying why it does not divide."""
    for name, size in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel)):
        if not isinstance(size, int) or size < 1:
            raise ParallelConfigError(f"{name} must be a positive integer, got {size!r}")
    cell = tensor_parallel * pipeline_parallel
    if world_size % cell:
        raise ParallelConfigError(f"tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} = "
                                  f"{cell} ranks does not divide the world size {world_size}")
    return world_size // cell, pipeline_parallel, tensor_parallel


def mesh_coords(rank: int, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of global `rank`: rank = (dp * pipeline_parallel + pp) * tensor_parallel + tp."""
    cell, tp = divmod(rank, tensor_parallel)
    dp, pp = divmod(cell, pipeline_parallel)
    return dp, pp, tp


def parallel_mesh(tensor_parallel: int = 1, pipeline_parallel: int = 1, device_type: str | None = None
                  ) -> DeviceMesh:
    """This world as a DeviceMesh with dims ("dp", "pp", "tp") in Megatron's order (tp ranks adjacent), built once
    per process and layout. `device_type` defaults to "cuda" under NCCL, else "cpu"."""
    if not dist.is_available() or not dist.is_initialized():
        raise ParallelConfigError("parallel_mesh needs an initialised torch.distributed process group "
                                  "(torchrun + cocoweave.launch.init_from_env, or a cocoweave LocalWorld)")
    shape = mesh_shape(dist.get_world_size(), tensor_parallel, pipeline_parallel)
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    key = (id(dist.group.WORLD), shape, device_type)  # a new default group (a restarted world) gets new meshes
    if key not in _MESHES:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        for dim in MESH_DIMS:
            inherit_timeout(mesh.get_group(dim))
        _MESHES[key] = mesh
    return _MESHES[key]


def parallel_groups(tensor_parallel: int, pipeline_parallel: int = 1) -> tuple[Any, Any]:
    """(tensor-parallel group, data-parallel group) of this rank in parallel_mesh's layout; (None, None) in a world
    of one rank (None means the world to cocoweave.nn)."""
    world = group_size(None)
    mesh_shape(world, tensor_parallel, pipeline_parallel)
    if world == 1:
        return None, None
    mesh = parallel_mesh(tensor_parallel, pipeline_parallel)
    return mesh.get_group("tp"), mesh.get_group("dp")
