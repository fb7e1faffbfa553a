"""Process groups of a data x tensor parallel layout (Megatron's order: tensor-parallel ranks adjacent).

    tp_group, dp_group = parallel_groups(tensor_parallel=2)     # world 4: tp {0,1} {2,3}, dp {0,2} {1,3}
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import ParallelConfigError

_CACHE: dict[tuple[int, ...], Any] = {}


def new_group(ranks: list[int]) -> Any:
    """A process group of `ranks`, created once per process (every rank must ask for the same groups in order)."""
    key = tuple(ranks)
    if key not in _CACHE:
        _CACHE[key] = dist.new_group(list(ranks))
    return _CACHE[key]


def parallel_groups(tensor_parallel: int) -> tuple[Any, Any]:
    """(tensor-parallel group, data-parallel group) of this rank: world ranks r = dp * t + tp."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tensor_parallel < 1 or world % tensor_parallel:
        raise ParallelConfigError(f"tensor_parallel={tensor_parallel} does not divide the world size {world}")
    if world == 1:
        return None, None
    rank, t = dist.get_rank(), tensor_parallel
    tp = dp = None
    for d in range(world // t):  # every rank creates every group, in the same order
        g = new_group([d * t + i for i in range(t)])
        tp = g if rank // t == d else tp
    for i in range(t):
        g = new_group([d * t + i for d in range(world // t)])
        dp = g if rank % t == i else dp
    return tp, dp
