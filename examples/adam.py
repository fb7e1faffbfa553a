"""Data-parallel Adam (CoCoNet's first workload): average the gradients, then update w, m, v.
The program lives in cocoweave.workloads; `cocoweave show examples/adam.py:adam -s N=64` prints it."""

import cocoweave as cw
from cocoweave import workloads


def adam(N: int = 1 << 20) -> cw.Program:
    return workloads.adam(N)
