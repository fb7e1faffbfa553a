"""The torch.distributed backend: plans become generated Python per rank, run over Gloo or NCCL."""

from .executable import Executable
from .worker import run_schedules, time_schedule

__all__ = ["Executable", "run_schedules", "time_schedule"]
