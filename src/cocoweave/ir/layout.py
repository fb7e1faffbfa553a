"""Layouts: how a logical tensor is held by the ranks of a process group.

- `Replicated`: every rank holds the same full tensor.
- `Local`: every rank holds a full-shape tensor with its own values (a gradient before reduction).
- `Sliced(dim)`: the tensor is split along `dim` into one contiguous part per rank
  (`torch.tensor_split` sizes); rank r holds part r.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .types import bind_shape

if TYPE_CHECKING:
    from .graph import Value


class Layout:
    """Base class of the three layouts."""

    kind: str = ""

    @property
    def is_replicated(self) -> bool:
        return self.kind == "replicated"

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    @property
    def is_sliced(self) -> bool:
        return self.kind == "sliced"


@dataclass(frozen=True)
class _Replicated(Layout):
    kind: str = "replicated"

    def __repr__(self) -> str:
        return "Replicated"


@dataclass(frozen=True)
class _Local(Layout):
    kind: str = "local"

    def __repr__(self) -> str:
        return "Local"


@dataclass(frozen=True)
class Sliced(Layout):
    """Split along `dim` (negative dims count from the end until bound to a tensor)."""

    dim: int = 0
    kind: str = "sliced"

    def __repr__(self) -> str:
        return f"Sliced({self.dim})"


Replicated = _Replicated()
Local = _Local()


def slice_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `size` split in `parts` like torch.tensor_split."""
    q, r = divmod(size, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def local_shape(v: Value, sizes: Mapping[str, int], group_rank: int, group_size: int) -> tuple[int, ...]:
    """Shape of group rank `group_rank`'s part of value `v` with its sizes bound."""
    full = list(bind_shape(v.shape, sizes))
    if v.layout.is_sliced:
        start, stop = slice_bounds(full[v.layout.dim], group_size, group_rank)
        full[v.layout.dim] = stop - start
    return tuple(full)
