"""The data-parallel group an optimizer works over: this rank's place in it, whether its ranks share a host, and the
keys of the job's store its rendezvous use."""

from __future__ import annotations

import itertools
from typing import Any

import torch.distributed as dist

from ..backends.torch import shm
from ..errors import OptimizerError
from ..rankenv import RankEnv

INSTANCES = itertools.count()  # optimizers made in this process, in order: the same on every rank


def world(group: Any = None) -> tuple[int, int]:
    """(rank, size) in `group` (the default process group when None); (0, 1) when torch.distributed is not
    initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def store_prefix(instance: int, group: Any) -> str:
    """An optimizer's keys in the job's store: its instance and its group's global ranks, so that optimizers over
    different groups (one per pipeline stage or data-parallel line) never meet on one key."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return f"cocoweave/optim/{instance}/g{'-'.join(map(str, ranks))}"


def one_host(group: Any) -> bool:
    """Whether every rank of `group` runs on this host (the shared-memory algorithm then applies)."""
    return shm.group_for(group) is not None


def check_torchrun(group: Any) -> None:
    """Under torchrun with several ranks, torch.distributed must be initialised: each rank would train alone."""
    size = RankEnv.from_env().world_size
    if size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise OptimizerError(f"this process is one of {size} ranks (WORLD_SIZE={size}) but torch.distributed is not "
                             "initialised: call torch.distributed.init_process_group() (or "
                             "cocoweave.launch.init_from_env()) before creating the optimizer, or each rank trains "
                             "alone")
