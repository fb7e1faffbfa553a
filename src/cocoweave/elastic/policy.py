"""Batch policies: how a global batch splits over any world size (`keep_global`), or grows with it and moves the
learning rate by a rule (`scale`); `StepPlan` is one world size's split into ranks and micro-batches."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ElasticError
from ..ir.layout import split_sizes

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
