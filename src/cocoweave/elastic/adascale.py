"""AdaScale (Johnson et al. 2020): the learning-rate gain of a grown batch, from the per-sample gradient variance
and squared gradient norm, estimated each step from the ranks' gradients (`gradient_moments`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..backends.torch import placement
from ..errors import ElasticError
from ..sharding import is_dtensor, local
from .policy import _count


def gradient_moments(grads: Sequence[torch.Tensor], group: Any = None) -> tuple[float, float]:
    """(sum over the ranks of |g_i|^2, |mean of the g_i|^2) of this rank's local gradients `grads` (before any
    reduction) and the other ranks' of `group`: every rank calls it. Costs one all-reduce of the gradients (and one
    of a scalar), on top of the optimizer's own reduction. A tensor-parallel model's gradients (DTensors sharded over
    another mesh dim) count their parts once each: the moments are the whole model's, the same on every rank."""
    parts = [local(g).detach().reshape(-1).float() for g in grads]
    # none here: a zero where the group takes tensors (NCCL alone: this process's GPU)
    flat = torch.cat(parts) if parts else torch.zeros(
        1, device=placement.metadata_device(group, placement.compute_device()))
    size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    squares = flat.double().pow(2)
    if size > 1:  # flat is a new tensor (torch.cat): reduced in place
        dist.all_reduce(flat, group=group)
    means = (flat.double() / size).pow(2)
    sums: dict[Any, torch.Tensor] = {}  # per mesh a sharded part spans (None: replicated or plain): [s, m]
    start = 0
    for g, part in zip(grads, parts):
        end = start + part.numel()
        sharded = is_dtensor(g) and g.device_mesh.size() > 1 and any(pl.is_shard() for pl in g.placements)
        key = g.device_mesh if sharded else None
        pair = torch.stack((squares[start:end].sum(), means[start:end].sum()))
        sums[key] = sums[key] + pair if key in sums else pair
        start = end
    total = sums.pop(None, squares.new_zeros(2))
    for mesh, pair in sums.items():  # a sharded part's moments summed over the ranks holding its other parts
        dist.all_reduce(pair, group=mesh.get_group())
        total = total + pair
    if size > 1:  # the squares summed over the group's ranks (the means are the group's already)
        square_sum = total[:1].clone()
        dist.all_reduce(square_sum, group=group)
        total = torch.cat((square_sum, total[1:]))
    return float(total[0]), float(total[1])


class AdaScale:
    """AdaScale's gain ratio r = (s2/B0 + m2) / (s2/B + m2) for a global batch B against the base batch B0, from
    moving averages of the per-sample gradient variance s2 and the squared norm m2 of the true gradient.

    Each step, W ranks of b samples each give local gradients g_i and their mean g (`gradient_moments`):
    s2 = b (sum |g_i|^2 - W |g|^2) / (W - 1) and m2 = |g|^2 - s2 / B are unbiased. As the paper's appendix B.3,
    the averages are plain means for the first 1 / (1 - theta) steps and then exponential with theta =
    max(1 - W / 1000, 0). s2 and m2 do not depend on the batch, so they carry over a resize. `progress` sums the
    gains: the paper's scale-invariant iterations (base-batch steps done)."""

    def __init__(self, base_batch: int) -> None:
        self.base_batch = _count(base_batch, "AdaScale's base batch")
        self.var = 0.0  # per-sample gradient variance (trace of the covariance)
        self.sqr = 0.0  # squared norm of the expected gradient
        self.count = 0  # estimates averaged so far
        self.progress = 0.0

    def update(self, local_sq_sum: float, mean_sq: float, ranks: int, rank_batch: int) -> None:
        """Add one step's estimate from `gradient_moments` of `ranks` ranks with `rank_batch` samples each (one rank
        gives no variance estimate: the averages stay as they are)."""
        if ranks < 2:
            return
        batch = ranks * rank_batch
        var = max(rank_batch * (local_sq_sum - ranks * mean_sq) / (ranks - 1), 0.0)
        sqr = max(mean_sq - var / batch, 0.0)
        self.count += 1
        theta = max(1.0 - ranks / 1000.0, 0.0)
        keep = (self.count - 1) / self.count if self.count < 1.0 / (1.0 - theta) else theta
        self.var = keep * self.var + (1.0 - keep) * var
        self.sqr = keep * self.sqr + (1.0 - keep) * sqr

    def gain(self, batch: int) -> float:
        """r for a global batch of `batch` samples: k = batch / base batch when nothing is known yet or the gradient
        is all noise, 1 when it has no noise."""
        k = batch / self.base_batch
        if self.count == 0 or self.var + self.sqr <= 0.0:
            return k
        return (self.var / self.base_batch + self.sqr) / (self.var / batch + self.sqr)

    def step(self, batch: int) -> float:
        """The gain for this step's batch, counted into `progress`."""
        r = self.gain(batch)
        self.progress += r
        return r

    @property
    def noise_scale(self) -> float | None:
        """s2 / m2: the batch at which noise and signal are equal (McCandlish et al. 2018's simple noise scale)."""
        return self.var / self.sqr if self.count and self.sqr > 0 else None

    def state_dict(self) -> dict[str, float]:
        return {"base_batch": self.base_batch, "var": self.var, "sqr": self.sqr, "count": self.count,
                "progress": self.progress}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["base_batch"]) != self.base_batch:
            raise ElasticError(f"the saved AdaScale state is for a base batch of {state['base_batch']}, "
                               f"this one's is {self.base_batch}")
        self.var, self.sqr = float(state["var"]), float(state["sqr"])
        self.count, self.progress = int(state["count"]), float(state["progress"])
