"""A CLI command run as one rank of a torchrun world (`run` and `check --backend torch`): join the process group,
end a rank still going after the wall timeout, turn a failure into one sentence naming the rank and its stage
(exit 4), gather each rank's result on rank 0, and leave the group cleanly (exit 0 on every rank)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LoadError
from .common import EXIT_RANK_FAILED
from .options import parse_world_sizes


@dataclass(frozen=True)
class TorchrunRank:
    """This process's place: its rank, the world size, its device, and where results say they ran."""

    rank: int
    size: int
    device: torch.device
    where: str


@contextmanager
def torchrun_rank(timeouts: tuple[float, float | None], device: str | None,
                  world_size: str | None = None) -> Iterator[TorchrunRank]:
    """Join torchrun's world for the body; `world_size` (the user's -n, None if not given) must be torchrun's. The
    group is left cleanly when the body ends normally, destroyed otherwise."""
    import torch.distributed as dist

    from ..launch import init_from_env, shutdown

    timeout, wall = timeouts
    rank, size, dev = init_from_env(timeout, backend="gloo" if device == "cpu" else None)
    where = f"torch, {dist.get_backend()} on {'cpu' if device == 'cpu' else dev.type}, torchrun"
    timer = None if wall is None else _exit_after(wall, rank)
    ok = False
    try:
        if world_size is not None and parse_world_sizes(world_size) != [size]:
            raise LoadError(f"--world-size {world_size} differs from torchrun's WORLD_SIZE {size}")
        yield TorchrunRank(rank, size, torch.device("cpu") if device == "cpu" else dev, where)
        ok = True
    finally:
        if ok:
            shutdown()  # every rank waits for the others, then destroys the group: a clean exit 0
        elif dist.is_initialized():
            dist.destroy_process_group()
        if timer is not None:
            timer.cancel()


def gather_on_rank0(me: TorchrunRank, compute: Callable[[], Any]) -> list[Any] | None:
    """Every rank's `compute()` in rank order on rank 0 (None on the others); a failure here or on another rank is
    one sentence naming this rank and its stage."""
    import torch.distributed as dist

    from .. import faults
    from ..launch import rank_failure

    gathered: list[Any] = [None] * me.size
    try:
        mine = compute()
        faults.reset_stage()  # past the generated step: a failure from here on is at no stage of it
        dist.gather_object(mine, gathered if me.rank == 0 else None, dst=0)
    except Exception as exc:  # noqa: BLE001 - another rank died, hung or diverged, or this one failed
        raise rank_failure(exc, me.rank) from None
    return gathered if me.rank == 0 else None


def _exit_after(seconds: float, rank: int) -> threading.Timer:
    """End this rank with exit code 4 and a sentence if it is still going after `seconds`."""
    from .. import faults

    def expire() -> None:
        stage = faults.current_stage()
        at = f" (at {faults.where(*stage)})" if stage else ""
        print(f"error: rank {rank} did not finish within the wall timeout of {seconds:g} s{at}", file=sys.stderr,
              flush=True)
        os._exit(EXIT_RANK_FAILED)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
