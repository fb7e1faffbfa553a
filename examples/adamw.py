"""Data-parallel AdamW as torch.optim.AdamW computes it (decoupled weight decay); the program that
cocoweave.optim.DistributedAdamW runs. `cocoweave schedules examples/adamw.py:adamw -s N=64`."""

import cocoweave as cw
from cocoweave import workloads


def adamw(N: int = 1 << 20) -> cw.Program:
    return workloads.adamw(N)
