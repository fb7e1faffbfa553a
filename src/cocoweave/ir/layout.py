"""Layouts: how a logical tensor is held by the ranks of a process group.

A layout gives, per axis of the group's mesh, a *placement* (a group without a mesh is one axis, and its
layouts are bare placements, as they always were):
- `Replicated`: every rank along the axis holds the same tensor.
- `Local`: every rank along the axis holds a tensor with its own values (a gradient before reduction, a
  partial matmul sum).
- `Sliced(dim)`: the tensor is split along `dim` into one contiguous part per rank along the axis
  (`torch.tensor_split` sizes), or in proportion to `shares` (`Sliced(0, shares=(3, 1))`).

On a mesh of several axes a layout is `Layout(x=Sliced(0), y=Replicated)` (axes left out are Replicated)
or `Layout(Sliced(0), Replicated)` (one placement per axis, in mesh order). A dimension sliced by several
axes is split by them in mesh order, the first axis outermost (as DTensor's placements).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ProgramError
from .types import bind_shape

if TYPE_CHECKING:
    from .graph import Value


class Layout:
    """Base class of layouts: the three placements and the per-axis `Layout(...)` of a mesh.

    `Layout(x=Sliced(0), y=Replicated)` or `Layout(Sliced(0), Replicated)` builds a mesh layout."""

    kind: str = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Layout:
            return MeshLayout(*args, **kwargs)
        return super().__new__(cls)

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
    """Split along `dim` (negative dims count from the end until bound to a tensor); `shares` (positive ints,
    one per rank along the axis) split it in proportion, else in equal parts (torch.tensor_split sizes)."""

    dim: int = 0
    shares: tuple[int, ...] | None = None
    kind: str = "sliced"

    def __post_init__(self) -> None:
        if self.shares is not None:
            shares = check_shares(self.shares, "Sliced")
            object.__setattr__(self, "shares", None if len(set(shares)) == 1 else shares)

    def __repr__(self) -> str:
        return f"Sliced({self.dim})" if self.shares is None else f"Sliced({self.dim}, shares={self.shares})"


Replicated = _Replicated()
Local = _Local()
Placement = _Replicated | _Local | Sliced


class MeshLayout(Layout):
    """One placement per mesh axis: `Layout(x=Sliced(0), y=Replicated)` (named; axes left out are Replicated)
    or `Layout(Sliced(0), Replicated)` (in mesh order). A program binds it to its mesh."""

    kind = "mesh"

    def __init__(self, *placements: Any, **by_axis: Any) -> None:
        if placements and by_axis:
            raise ProgramError("a Layout takes placements by position or by axis name, not both")
        if len(placements) == 1 and isinstance(placements[0], tuple | list):
            placements = tuple(placements[0])
        items = tuple(by_axis.values()) if by_axis else tuple(placements)
        for p in items:
            if not isinstance(p, _Replicated | _Local | Sliced):
                raise ProgramError(f"a Layout holds cw.Replicated, cw.Local or cw.Sliced(dim) per axis, got {p!r}")
        object.__setattr__(self, "axes", tuple(by_axis) if by_axis else None)
        object.__setattr__(self, "placements", items)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Layout is immutable")

    def on(self, axis: str) -> Placement:
        """The placement along mesh axis `axis`."""
        return self.placements[self.axes.index(axis)]

    @property
    def is_replicated(self) -> bool:
        return all(p.is_replicated for p in self.placements)

    @property
    def is_local(self) -> bool:
        return any(p.is_local for p in self.placements)

    @property
    def is_sliced(self) -> bool:
        return any(p.is_sliced for p in self.placements)

    def __eq__(self, other: object) -> bool:
        """Equal placements on every axis (an axis a named layout leaves out is Replicated)."""
        if not isinstance(other, MeshLayout):
            return False
        if self.axes is not None and other.axes is not None:
            return self._named() == other._named()
        return self.placements == other.placements

    def _named(self) -> dict[str, Placement]:
        return {a: p for a, p in zip(self.axes, self.placements) if not p.is_replicated}

    def __hash__(self) -> int:
        return hash(tuple(sorted(repr(p) for p in self.placements if not p.is_replicated)))

    def __repr__(self) -> str:
        if self.axes is None:
            return f"Layout({', '.join(map(repr, self.placements))})"
        return f"Layout({', '.join(f'{a}={p!r}' for a, p in zip(self.axes, self.placements))})"


def check_shares(shares: Any, what: str) -> tuple[int, ...]:
    """`shares` as a tuple of positive ints; ProgramError naming `what` otherwise."""
    try:
        out = tuple(shares)
    except TypeError:
        raise ProgramError(f"{what}: shares must be a sequence of positive ints, got {shares!r}") from None
    if not out or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in out):
        raise ProgramError(f"{what}: shares must be a sequence of positive ints, got {shares!r}")
    return out


def shares_from_speeds(speeds: Sequence[float], resolution: int = 64) -> tuple[int, ...]:
    """Shares in proportion to measured speeds (e.g. 1 / seconds per step of each rank), as positive ints of
    about `resolution` in total: what `Sliced(dim, shares=...)`, `Schedule.split(..., shares=...)` and
    `all_reduce(..., weights=...)` take."""
    if not speeds or not all(s > 0 for s in speeds):
        raise ProgramError(f"shares need a positive speed per rank, got {list(speeds)}")
    total = sum(speeds)
    return tuple(max(1, round(resolution * s / total)) for s in speeds)


def placements(layout: Layout, n_axes: int = 1) -> tuple[Placement, ...]:
    """The placement per axis: a mesh layout's own, or a bare Replicated/Local on every one of `n_axes`."""
    if isinstance(layout, MeshLayout):
        return layout.placements
    return (layout,) * n_axes


def split_sizes(size: int, parts: int | Sequence[int]) -> list[int]:
    """Sizes of the parts of `size` split into `parts` equal parts (torch.tensor_split sizes) or in proportion
    to `parts` shares: each part gets the floor of its share, the first ones one more until `size` is used."""
    shares = [1] * parts if isinstance(parts, int) else list(parts)
    total = sum(shares)
    out = [size * s // total for s in shares]
    for i in range(size - sum(out)):
        out[i] += 1
    return out


def share_bounds(size: int, parts: int | Sequence[int], index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `size` split into `parts` (a count or shares), as `split_sizes`."""
    if isinstance(parts, int):
        return slice_bounds(size, parts, index)
    sizes = split_sizes(size, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def slice_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `size` split in `parts` like torch.tensor_split."""
    q, r = divmod(size, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


@dataclass(frozen=True)
class Position:
    """Where a rank sits in a value's process group: its index along each mesh axis and the axis sizes
    (a group without a mesh is one axis: the group rank and the group size)."""

    coords: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def group_rank(self) -> int:
        """The rank's index in its group (row-major over the mesh axes)."""
        r = 0
        for c, n in zip(self.coords, self.shape):
            r = r * n + c
        return r


def parts_along(p: Sliced, axis_size: int) -> int | tuple[int, ...]:
    """How placement `p` splits its dimension along an axis of `axis_size` ranks: a count or its shares."""
    return p.shares if p.shares is not None else axis_size


def part_bounds(layout: Layout, full: Sequence[int], pos: Position) -> list[tuple[int, int]]:
    """[start, stop) per dimension of the part of a tensor of shape `full` held at `pos`: every axis that
    slices a dimension cuts the part of the axes before it (mesh order, the first outermost)."""
    bounds = [(0, int(s)) for s in full]
    for p, c, n in zip(placements(layout, len(pos.coords)), pos.coords, pos.shape):
        if p.is_sliced:
            start, stop = bounds[p.dim]
            a, b = share_bounds(stop - start, parts_along(p, n), c)
            bounds[p.dim] = (start + a, start + b)
    return bounds


def part_shape(layout: Layout, full: Sequence[int], pos: Position) -> tuple[int, ...]:
    """The shape of the part of a tensor of shape `full` held at `pos`."""
    return tuple(stop - start for start, stop in part_bounds(layout, full, pos))


def local_shape(v: Value, sizes: Mapping[str, int], pos: Position) -> tuple[int, ...]:
    """Shape of the part of value `v` held at `pos` (its place in v's group) with its sizes bound."""
    return part_shape(v.layout, bind_shape(v.shape, sizes), pos)


def cut(t: Any, have: Sequence[tuple[int, int]], want: Sequence[tuple[int, int]]) -> Any:
    """Narrow tensor `t`, which holds the logical ranges `have` (per dimension), to the ranges `want` within."""
    for d, (h, w) in enumerate(zip(have, want)):
        if h != w:
            t = t.narrow(d, w[0] - h[0], w[1] - w[0])
    return t


def largest_position(layout: Layout, full: Sequence[int], shape: tuple[int, ...]) -> Position:
    """The position (in a mesh of `shape`) holding the largest part of a tensor of shape `full`: along each
    axis, the index whose part is largest (the first one of equal parts)."""
    bounds = [(0, int(s)) for s in full]
    coords = []
    for p, n in zip(placements(layout, len(shape)), shape):
        if not p.is_sliced:
            coords.append(0)
            continue
        start, stop = bounds[p.dim]
        sizes = split_sizes(stop - start, parts_along(p, n))
        c = sizes.index(max(sizes))
        coords.append(c)
        bounds[p.dim] = (start, start + sizes[c])
    return Position(tuple(coords), shape)
