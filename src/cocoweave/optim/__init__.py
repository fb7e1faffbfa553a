"""Drop-in optimizers that replace DDP + a torch optimizer: train the plain model (no DDP wrapper); step() reduces
the gradients and updates the parameters with one compiled cocoweave program per bucket.

    dist.init_process_group("gloo")          # or NCCL; under torchrun
    opt = cocoweave.optim.DistributedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()   # zero_grad() between steps: buckets are reduced in place
"""

from .base import DistributedOptimizer, resolve_schedule
from .optimizers import DistributedAdam, DistributedAdamW, DistributedLAMB, DistributedOptions, DistributedSGD

__all__ = ["DistributedAdam", "DistributedAdamW", "DistributedLAMB", "DistributedOptimizer", "DistributedOptions",
           "DistributedSGD", "resolve_schedule"]
