"""Elastic training: what a data-parallel job trains when its world grows or shrinks, chosen explicitly.

    policy = BatchPolicy.keep_global(12, micro_batch=4)          # or BatchPolicy.scale(16, 4, lr_rule="sqrt")
    sampler = ElasticSampler(len(dataset), seed=0)               # sampler.state_dict() goes into the checkpoint
    plan = policy.plan(world_size)                               # again after every restart at a new size
    batch = sampler.next_batch(plan.global_batch)                # every step; the same on every rank
    for part in plan.micro_batches(rank):                        # no_sync() for all but the last
        (mean_loss(batch[part.start:part.stop]) * plan.weight(len(part))).backward()
    optimizer.param_groups[0]["lr"] = base_lr * plan.lr_scale    # (x AdaScale's gain for lr_rule="adascale")

Policies:
- `keep_global`: the global batch B stays fixed. Rank r of W takes B // W samples, one more for r < B % W
  (12 on 5 ranks: 3, 3, 2, 2, 2), in micro-batches of at most `micro_batch` samples with gradient accumulation;
  each micro-batch's mean loss is weighted so that the gradient averaged over the ranks is the mean over all B
  samples. The optimisation is the same at every world size, float rounding aside.
- `scale`: each rank keeps b = B0 / W0 samples (B0 the global batch at the base world size W0), so the global
  batch is b x W, and the learning rate follows a rule of k = W / W0:
    linear   lr0 x k            Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
    sqrt     lr0 x sqrt(k)      Krizhevsky 2014, "One weird trick for parallelizing convolutional neural
                                networks"; Hoffer et al. 2017, "Train longer, generalize better"; for Adam,
                                Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"
    adascale lr0 x r_t          Johnson et al. 2020, "AdaScale SGD: A User-Friendly Algorithm for Distributed
                                Training": r_t = (s2/B0 + m2) / (s2/B + m2) in [min(1, k), max(1, k)], from the
                                per-sample gradient variance s2 and squared gradient norm m2, estimated each step
                                from the ranks' gradients (`AdaScale`, `gradient_moments`); its theory is for SGD
                                (with Adam the gain is a heuristic).

`ElasticSampler` fixes the global sample order by (seed, epoch) and counts the samples consumed; each step takes
the next global batch of that order, split over the current ranks, so within an epoch no sample is skipped or seen
twice across resizes. The time and cost of a job under a resize schedule for each policy is the planner's model,
`cocoweave.cluster.planning.resize` (`predict_resizes`, `parse_schedule`: importable from here too).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from .backends.torch import placement
from .cluster.planning.resize import (  # noqa: F401 - the planner's model of a resized job, importable from here
    ElasticPrediction,
    PhaseCost,
    Resize,
    parse_schedule,
    predict_resizes,
    progress_per_step,
)
from .errors import ElasticError
from .ir.layout import split_sizes
from .sharding import is_dtensor, local

Mode = Literal["keep_global", "scale"]
MODES = ("keep_global", "scale")
LR_RULES = ("linear", "sqrt", "adascale")


def _count(value: Any, what: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ElasticError(f"{what} must be an integer of at least {low}, got {value!r}")
    return value


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """`total` items in `parts` contiguous shares, the first `total % parts` one larger (torch.tensor_split sizes)."""
    return tuple(split_sizes(total, parts))


# ---------------------------------------------------------------------------------------------------------
# Batch policies
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """What every rank of a world of `world_size` does in one optimizer step under a policy."""

    world_size: int
    global_batch: int
    shares: tuple[int, ...]  # samples of each rank, in rank order (positions within the global batch)
    micro_batch: int | None  # the most samples a rank runs forward at once (None: its whole share)
    lr_scale: float  # the base learning rate's multiplier (AdaScale's gain, when used, comes on top, per step)

    def rank_range(self, rank: int) -> range:
        """Positions of `rank`'s samples within the global batch."""
        if not 0 <= rank < self.world_size:
            raise ElasticError(f"rank {rank} is not in a world of {self.world_size}")
        start = sum(self.shares[:rank])
        return range(start, start + self.shares[rank])

    def micro_batches(self, rank: int) -> list[range]:
        """Positions (within the global batch) of each micro-batch of `rank`, as evenly sized as the cap allows."""
        mine = self.rank_range(rank)
        count = 1 if self.micro_batch is None else -(-len(mine) // self.micro_batch)
        out, start = [], mine.start
        for size in split_evenly(len(mine), count):
            out.append(range(start, start + size))
            start += size
        return out

    @property
    def accumulation(self) -> int:
        """The most micro-batches any rank runs in one step."""
        return max(len(self.micro_batches(r)) for r in range(self.world_size))

    def weight(self, count: int) -> float:
        """The factor for the mean loss of `count` samples of one rank such that the gradient averaged over the
        ranks (DDP, DistributedAdamW with reduction="avg") is the mean over the whole global batch."""
        return count * self.world_size / self.global_batch


@dataclass(frozen=True)
class BatchPolicy:
    """How the global batch and learning rate follow the world size (see the module's docstring).

    `global_batch` is the fixed global batch (keep_global) or the global batch at `base_world` ranks (scale);
    `micro_batch` caps the samples a rank runs forward at once (gradient accumulation beyond it)."""

    mode: Mode
    global_batch: int
    base_world: int = 1
    lr_rule: str | None = None
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ElasticError(f"the batch policy must be one of {', '.join(MODES)}, got {self.mode!r}")
        _count(self.global_batch, "the global batch")
        _count(self.base_world, "the base world size")
        if self.micro_batch is not None:
            _count(self.micro_batch, "the micro-batch cap")
        if self.mode == "keep_global" and self.lr_rule is not None:
            raise ElasticError(f"learning-rate rule {self.lr_rule!r} applies to the scale policy only: keep_global "
                               "keeps the global batch, and so the learning rate")
        if self.mode == "scale":
            if self.lr_rule not in LR_RULES:
                raise ElasticError(f"the scale policy needs a learning-rate rule, one of {', '.join(LR_RULES)}; "
                                   f"got {self.lr_rule!r}")
            if self.global_batch % self.base_world:
                raise ElasticError(f"the scale policy keeps each rank's batch, but a global batch of "
                                   f"{self.global_batch} does not split evenly over {self.base_world} base ranks")

    @classmethod
    def keep_global(cls, global_batch: int, micro_batch: int | None = None) -> BatchPolicy:
        """The global batch stays `global_batch` at every world size."""
        return cls("keep_global", global_batch, micro_batch=micro_batch)

    @classmethod
    def scale(cls, global_batch: int, base_world: int, lr_rule: str = "linear",
              micro_batch: int | None = None) -> BatchPolicy:
        """Each rank keeps `global_batch // base_world` samples; the learning rate follows `lr_rule`."""
        return cls("scale", global_batch, base_world, lr_rule, micro_batch)

    @property
    def rank_batch(self) -> int:
        """scale: the samples of each rank per step."""
        return self.global_batch // self.base_world

    def batch_at(self, world_size: int) -> int:
        """The global batch at `world_size` ranks."""
        _count(world_size, "the world size")
        return self.global_batch if self.mode == "keep_global" else self.rank_batch * world_size

    def lr_scale(self, world_size: int) -> float:
        """The base learning rate's multiplier at `world_size` ranks: 1 (keep_global, adascale before its gain),
        k (linear) or sqrt(k) (sqrt), k = the global batch over the base one."""
        k = self.batch_at(world_size) / self.global_batch
        return {"linear": k, "sqrt": math.sqrt(k)}.get(self.lr_rule or "", 1.0)

    def plan(self, world_size: int) -> StepPlan:
        """Each rank's share of a step at `world_size` ranks; every rank needs at least one sample."""
        batch = self.batch_at(world_size)
        if batch < world_size:
            raise ElasticError(f"a global batch of {batch} samples cannot be split over {world_size} ranks: "
                               "every rank needs at least one sample")
        return StepPlan(world_size, batch, split_evenly(batch, world_size), self.micro_batch,
                        self.lr_scale(world_size))

    def describe(self) -> str:
        cap = f", micro-batches of at most {self.micro_batch}" if self.micro_batch else ""
        if self.mode == "keep_global":
            return f"keep_global: {self.global_batch} samples per step at any world size{cap}"
        return (f"scale: {self.rank_batch} samples per rank (global {self.global_batch} at {self.base_world} "
                f"ranks), learning rate by the {self.lr_rule} rule{cap}")


# ---------------------------------------------------------------------------------------------------------
# The sample order
# ---------------------------------------------------------------------------------------------------------


class ElasticSampler(Sampler[int]):
    """The global order of a dataset's samples and how far training has consumed it.

    Epoch e is a permutation of range(num_samples) drawn from (seed, e) (the identity without `shuffle`); the
    position counts the samples consumed since the start, so a batch that crosses an epoch's end takes the rest
    of that epoch and the start of the next. The state (`state_dict`) is four integers: save it with the model.

    A `torch.utils.data.Sampler`: `DataLoader(dataset, sampler=sampler, batch_size=B, num_workers=2)` iterates the
    rest of the current epoch in the same global order as `next_batch`, each index drawn moving the position (a
    loader with workers draws up to prefetch_factor x num_workers batches ahead of the batches trained on)."""

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        super().__init__()
        self.num_samples = _count(num_samples, "the number of samples")
        self.seed = _count(seed, "the sampler's seed", low=0)
        self.shuffle = bool(shuffle)
        self.position = 0
        self._orders: dict[int, list[int]] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next sample belongs to."""
        return self.position // self.num_samples

    def order(self, epoch: int) -> list[int]:
        """The sample indices of `epoch` in the order training sees them."""
        if epoch not in self._orders:
            if not self.shuffle:
                order = list(range(self.num_samples))
            else:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=gen).tolist()
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        """The `count` sample indices at positions start, start + 1, ... of the global order."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(start + len(out), self.num_samples)
            out += self.order(epoch)[offset:offset + count - len(out)]
        return out

    def next_batch(self, count: int) -> list[int]:
        """The next `count` samples of the global order (the same on every rank); moves the position past them."""
        out = self.indices(self.position, _count(count, "the batch size"))
        self.position += count
        return out

    def __len__(self) -> int:
        """The samples left in the current epoch: what one iteration yields."""
        return self.num_samples - self.position % self.num_samples

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch's order, from the position; each index drawn moves the position past it."""
        for index in self.indices(self.position, len(self)):
            self.position += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"num_samples": self.num_samples, "seed": self.seed, "shuffle": int(self.shuffle),
                "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position; the saved order must be this sampler's (same samples, seed, shuffle)."""
        try:
            saved = (int(state["num_samples"]), int(state["seed"]), bool(state["shuffle"]))
            position = _count(state["position"], "the saved sampler position", low=0)
        except (KeyError, TypeError, ValueError) as exc:
            raise ElasticError(f"a sampler state needs integer num_samples, seed, shuffle and position ({exc})") \
                from None
        if saved != (self.num_samples, self.seed, self.shuffle):
            raise ElasticError(f"the saved sampler order (samples, seed, shuffle) = {saved} is not this sampler's "
                               f"{(self.num_samples, self.seed, self.shuffle)}; resume with the same data and seed")
        self.position = position


# ---------------------------------------------------------------------------------------------------------
# AdaScale (Johnson et al. 2020)
# ---------------------------------------------------------------------------------------------------------


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
