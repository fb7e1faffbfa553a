"""`ElasticSampler`: the global order of a dataset's samples, fixed by (seed, epoch), and how far training has
consumed it, so that a resize neither skips nor repeats a sample within an epoch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import ElasticError
from .policy import _count


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
