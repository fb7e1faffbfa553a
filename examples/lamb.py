"""Data-parallel LAMB (You et al. 2020): Adam's update direction scaled per tensor by the trust
ratio |w| / |u|. Its norms make reorder insert small all-reduces when the update moves onto slices.
`-s T=4` gives the [N, T] form (T tensors as columns) that cocoweave.optim.DistributedLAMB runs."""

import cocoweave as cw
from cocoweave import workloads


def lamb(N: int = 1 << 20, T: int | None = None) -> cw.Program:
    return workloads.lamb(N, T)
