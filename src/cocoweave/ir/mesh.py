"""Device meshes: a process group laid out as a grid of named axes (`p.mesh(dp=2, tp=2)`), as DTensor's
DeviceMesh. Rank r of the group sits at the row-major coordinates of r (the last axis varies fastest, so
the ranks of the last axis are consecutive); a collective over axis `a` runs within every set of ranks
that share their coordinates on the other axes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ProgramError

RESERVED_AXES = ("world",)


@dataclass(frozen=True)
class Mesh:
    """Named axes with their sizes, in order (the last axis varies fastest over the ranks)."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.axes:
            raise ProgramError("a mesh needs at least one axis, e.g. p.mesh(dp=2, tp=2)")
        for a, n in zip(self.axes, self.shape):
            if not isinstance(a, str) or not a.isidentifier() or a in RESERVED_AXES:
                raise ProgramError(f"mesh axis name {a!r} must be an identifier other than {', '.join(RESERVED_AXES)}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ProgramError(f"mesh axis `{a}` must have a positive int size, got {n!r}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def index(self, axis: str) -> int:
        """The position of `axis` among the mesh axes; ProgramError naming the axes if there is none."""
        if axis not in self.axes:
            raise ProgramError(f"the mesh {self} has no axis {axis!r}; its axes are {', '.join(self.axes)}")
        return self.axes.index(axis)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of group rank `rank` (row-major)."""
        out = []
        for n in reversed(self.shape):
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        """Group rank at `coords`."""
        r = 0
        for c, n in zip(coords, self.shape):
            r = r * n + c
        return r

    def axis_groups(self, axis: int) -> list[list[int]]:
        """The group ranks of every line along axis `axis` (ranks sharing the other coordinates), each in
        order along the axis; lines in the order of their lowest rank."""
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            out.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        return list(out.values())

    def line(self, rank: int, axis: int) -> list[int]:
        """The group ranks along axis `axis` through group rank `rank`, in order along the axis."""
        c = list(self.coords(rank))
        out = []
        for i in range(self.shape[axis]):
            c[axis] = i
            out.append(self.rank(tuple(c)))
        return out

    def __str__(self) -> str:
        return ", ".join(f"{a}={n}" for a, n in zip(self.axes, self.shape))
