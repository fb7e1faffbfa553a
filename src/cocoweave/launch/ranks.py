"""This rank's process state (its device, a dict that persists across runs) and the limits every entry point
checks (seconds of a timeout, ranks of a local world)."""

from __future__ import annotations

from typing import Any

import torch

from .. import settings
from ..errors import BackendError
from ..rankenv import cores

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer waits are a mistake (and overflow some timers)
MAX_RANKS_ENV = settings.MAX_LOCAL_RANKS.name

# Per-process state of a rank started by LocalWorld or init_from_env.
_RANK: dict[str, Any] = {}
_RANK_STATE: dict[str, Any] = {}


def rank_device() -> torch.device:
    """The device of this rank (cuda:i or cpu); cpu outside a rank."""
    return _RANK.get("device", torch.device("cpu"))


def rank_state() -> dict[str, Any]:
    """A dict private to this rank process that persists across `run` calls (caches, compiled steps)."""
    return _RANK_STATE


def check_seconds(value: float, what: str) -> float:
    """`value` as a float if it is a finite positive number of seconds up to a week, else BackendError."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise BackendError(f"{what} must be a number of seconds, got {value!r}") from None
    if not (0 < seconds <= MAX_TIMEOUT_S):  # also refuses NaN
        raise BackendError(f"{what} must be a finite number of seconds above 0 and at most {MAX_TIMEOUT_S:g} "
                           f"(a week), got {value!r}")
    return seconds


def max_local_ranks() -> int:
    """How many ranks a LocalWorld may start: $COCOWEAVE_MAX_LOCAL_RANKS, else 4 per core and at least 16."""
    return settings.MAX_LOCAL_RANKS.get() or max(16, 4 * cores())


def check_local_ranks(world_size: int) -> int:
    """`world_size` if a LocalWorld may start that many ranks here, else BackendError with a sentence."""
    if world_size < 1:
        raise BackendError(f"a local world needs at least one rank, got world_size={world_size}")
    if world_size > max_local_ranks():
        raise BackendError(f"a local world of {world_size} ranks is more than this machine should start "
                           f"(at most {max_local_ranks()}: 4 per core, at least 16; set {MAX_RANKS_ENV} "
                           "to allow more)")
    return world_size

