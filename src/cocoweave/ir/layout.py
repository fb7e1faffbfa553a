"""Layouts: how a logical tensor is held by the ranks of a process group.

- `Replicated`: every rank holds the same full tensor.
- `Local`: every rank holds a full-shape tensor with its own values (a gradient before reduction).
- `Sliced(dim)`: the tensor is split along `dim` into one contiguous part per rank
  (`torch.tensor_split` sizes); rank r holds part r.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def parse_layout(text: str) -> Layout:
    """Inverse of repr: 'Replicated', 'Local', 'Sliced(2)'."""
    if text == "Replicated":
        return Replicated
    if text == "Local":
        return Local
    if text.startswith("Sliced(") and text.endswith(")"):
        return Sliced(int(text[7:-1]))
    raise ValueError(f"unknown layout {text!r}")


def slice_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `size` split in `parts` like torch.tensor_split."""
    q, r = divmod(size, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)
