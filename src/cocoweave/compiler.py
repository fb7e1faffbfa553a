"""`cocoweave.compiler`: turn a program or schedule into something that runs (`cw.compile`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import CocoweaveError
from .ir.graph import Program
from .plan import lower
from .schedule.schedule import Schedule


def compile(target: Program | Schedule, backend: str = "torch", sizes: Mapping[str, int] | None = None,  # noqa: A001
            device: str | torch.device | None = None, rank: int | None = None, world_size: int | None = None,
            schedule: str | None = None, group: Any = None, kernels: str | None = None):
    """An executable for this rank of an initialised torch.distributed world (backend "torch"), or
    for every simulated rank at once (backend "reference": call it with a list of per-rank inputs).
    schedule="auto" runs a Program with the tuner's cached choice (`cocoweave tune`), or as written
    with a warning when nothing is cached for this world size and device. `group` (a torch.distributed
    process group) plays the program's world: rank and world size are then taken in it. `kernels` chooses how fused
    stages run (Executable's route: "auto", "compiled", "triton" or "torch"; default $COCOWEAVE_KERNELS or "auto")."""
    if schedule not in (None, "auto"):
        raise CocoweaveError(f"schedule must be None or 'auto', got {schedule!r}; pass a Schedule as the target")
    auto = schedule == "auto" and isinstance(target, Program)
    schedule = target if isinstance(target, Schedule) else Schedule(target)
    if backend == "reference":
        if auto and world_size is not None:
            from .tune import auto_schedule

            schedule = auto_schedule(target, sizes or {}, world_size, "torch", "cpu")
        from .backends import reference

        return lambda inputs: reference.run(schedule, inputs, sizes)
    if backend != "torch":
        raise CocoweaveError(f"unknown backend {backend!r}; use 'torch' or 'reference'")
    import torch.distributed as dist

    from .backends.torch import Executable

    if rank is None or world_size is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    if auto:
        from .tune import auto_schedule

        schedule = auto_schedule(target, sizes or {}, world_size, "torch", str(torch.device(device).type))
    return Executable(lower(schedule), rank, world_size, sizes, device, kernels=kernels, group=group)
