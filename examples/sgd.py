"""Data-parallel SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD
computes it; the program that cocoweave.optim.DistributedSGD runs."""

import cocoweave as cw
from cocoweave import workloads


def sgd(N: int = 1 << 20) -> cw.Program:
    return workloads.sgd(N)
