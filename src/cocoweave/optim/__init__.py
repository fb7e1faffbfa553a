"""Drop-in optimizers that replace DDP + a torch optimizer: after loss.backward() on the plain model,
step() reduces the gradients and updates the parameters with one tuned cocoweave program per bucket.

    opt = cocoweave.optim.DistributedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from .base import DistributedOptimizer, resolve_schedule
from .optimizers import DistributedAdamW, DistributedLAMB, DistributedSGD

__all__ = ["DistributedAdamW", "DistributedLAMB", "DistributedOptimizer", "DistributedSGD", "resolve_schedule"]
