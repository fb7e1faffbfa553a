"""The data-parallel group an optimizer works over: the keys of the job's store its rendezvous use, and the check
that torch.distributed is up under torchrun (the group's facts: cocoweave.group_facts)."""

from __future__ import annotations

import itertools
from typing import Any

import torch.distributed as dist

from ..errors import OptimizerError
from ..rankenv import RankEnv

INSTANCES = itertools.count()  # optimizers made in this process, in order: the same on every rank


def store_prefix(instance: int, group: Any) -> str:
    """An optimizer's keys in the job's store: its instance and its group's global ranks, so that optimizers over
    different groups (one per pipeline stage or data-parallel line) never meet on one key."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return f"cocoweave/optim/{instance}/g{'-'.join(map(str, ranks))}"


def check_torchrun(group: Any) -> None:
    """Under torchrun with several ranks, torch.distributed must be initialised: each rank would train alone."""
    size = RankEnv.from_env().world_size
    if size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise OptimizerError(f"this process is one of {size} ranks (WORLD_SIZE={size}) but torch.distributed is not "
                             "initialised: call torch.distributed.init_process_group() (or "
                             "cocoweave.launch.init_from_env()) before creating the optimizer, or each rank trains "
                             "alone")
