"""The program graph: a typed SSA DAG of values, built by calling DSL operations.

A `Value` is one node: the operation that made it, its operands and its type (dtype, shape,
layout, process group). Construction order is a topological order. A `Program` owns its
values, its named inputs (tensors and scalars), its outputs and its in-place updates.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProgramError
from .layout import Layout, MeshLayout, Placement, Position, Replicated, Sliced, placements
from .mesh import Mesh
from .printer import fingerprint, format_program
from .registry import apply
from .types import Dim, Shape, canonical_dtype, format_shape

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_location() -> str | None:
    """'file:line' of the innermost caller outside the cocoweave package (where the user wrote the op)."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _in_package(frame.f_code.co_filename):
            return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


@functools.lru_cache(maxsize=4096)
def _in_package(filename: str) -> bool:
    """Whether code of `filename` belongs to cocoweave (cached: rewrites ask for every frame of every op)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _short(path: str) -> str:
    """A path relative to the working directory when it lies below it, else as given."""
    full = os.path.abspath(path)
    cwd = os.getcwd() + os.sep
    return full[len(cwd):] if full.startswith(cwd) else path


@dataclass(frozen=True)
class Group:
    """A process group: the world, or stage `index` of the world split into `count` equal stages; laid out
    as `mesh` (named axes) when the program declares one."""

    name: str = "world"
    index: int = 0
    count: int = 1
    mesh: Mesh | None = None

    def ranks(self, world_size: int) -> range:
        """World ranks of this group; ProgramError if the world does not split evenly or fit the mesh."""
        if world_size % self.count:
            raise ProgramError(
                f"world size {world_size} cannot be split into {self.count} equal pipeline stages "
                f"(needed by process group `{self.name}`)"
            )
        size = world_size // self.count
        if self.mesh is not None and size != self.mesh.size:
            raise ProgramError(f"world size {world_size} does not fit the mesh {self.mesh} of process group "
                               f"`{self.name}` (it needs {self.mesh.size} ranks)")
        return range(self.index * size, (self.index + 1) * size)

    def size(self, world_size: int) -> int:
        return len(self.ranks(world_size))

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The axes a layout places a tensor along: a mesh's named axes when it has several, else one unnamed axis."""
        return self.mesh.axes if self.mesh is not None and len(self.mesh.axes) > 1 else (None,)

    def position(self, rank: int, world_size: int) -> Position:
        """Where world rank `rank` sits in this group: its mesh coordinates, or (group rank,) of (size,)."""
        ranks = self.ranks(world_size)
        gr = ranks.index(rank)
        if self.mesh is None:
            return Position((gr,), (len(ranks),))
        return Position(self.mesh.coords(gr), self.mesh.shape)

    def axis_size(self, world_size: int, axis: str | None) -> int:
        """Number of ranks along mesh axis `axis` (the group's size when it has no mesh or axis is None)."""
        if self.mesh is None or axis is None:
            return self.size(world_size)
        return self.mesh.shape[self.mesh.index(axis)]

    def lines(self, world_size: int, axis: str | None) -> list[list[int]]:
        """World ranks of every set of ranks a collective over `axis` runs within, each in order along the
        axis (the whole group when it has no mesh or axis is None)."""
        ranks = self.ranks(world_size)
        if self.mesh is None or axis is None:
            return [list(ranks)]
        return [[ranks[r] for r in line] for line in self.mesh.axis_groups(self.mesh.index(axis))]

    def line(self, rank: int, world_size: int, axis: str | None) -> list[int]:
        """World ranks of the collective group over `axis` that world rank `rank` belongs to."""
        ranks = self.ranks(world_size)
        if self.mesh is None or axis is None:
            return list(ranks)
        return [ranks[r] for r in self.mesh.line(ranks.index(rank), self.mesh.index(axis))]

    def __repr__(self) -> str:
        return self.name


WORLD = Group()


@dataclass(eq=False)
class Value:
    """One SSA value of a program: made by `op` from `args`, with attributes `attrs`."""

    program: Program
    id: int
    op: str
    args: tuple[Value, ...]
    attrs: dict[str, Any]
    dtype: str
    shape: Shape
    layout: Layout
    group: Group | None  # None for scalars and constants: valid in every group
    name: str
    loc: str | None = None

    # -- type queries -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The axes its layout places it along (Group.axes; one unnamed axis without a group)."""
        return self.group.axes if self.group is not None else (None,)

    @property
    def is_scalar(self) -> bool:
        """True for runtime scalars, constants and arithmetic on them only (no tensor involved)."""
        return self.group is None

    def along(self, axis: str | None) -> Placement:
        """Its placement along mesh axis `axis` (a collective's `axis` attribute; None: the only axis)."""
        axes = self.axes
        return placements(self.layout, len(axes))[axes.index(axis) if axis is not None else 0]

    def position(self, rank: int, world_size: int) -> Position:
        """Where world rank `rank` sits in this value's process group (its mesh coordinates)."""
        if self.group is None:
            return Position((0,), (1,))
        return self.group.position(rank, world_size)

    def type_str(self) -> str:
        if self.is_scalar:
            return f"{self.dtype} scalar"
        grp = "" if self.group is None or self.group.count == 1 else f" @{self.group.name}"
        return f"{self.dtype}{format_shape(self.shape)} {self.layout!r}{grp}"

    def describe(self) -> str:
        """A short operand description for error messages: `name: float32[N] Local`."""
        if self.op == "const":
            return repr(self.attrs["value"])
        return f"`{self.name}`: {self.type_str()}"

    def __repr__(self) -> str:
        return f"<{self.name}: {self.type_str()}>"

    def __hash__(self) -> int:
        return id(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # compact in hypothesis / IPython output
        printer.text(repr(self))

    def __bool__(self) -> bool:
        raise ProgramError(
            f"`{self.name}` is a program value and has no truth value while the program is built; "
            "use cw.where(cond, a, b) for data-dependent choices"
        )

    # -- operators: build new values ----------------------------------------------------------
    def __add__(self, o: Any) -> Value:
        return apply("add", self, o)

    def __radd__(self, o: Any) -> Value:
        return apply("add", o, self)

    def __sub__(self, o: Any) -> Value:
        return apply("sub", self, o)

    def __rsub__(self, o: Any) -> Value:
        return apply("sub", o, self)

    def __mul__(self, o: Any) -> Value:
        return apply("mul", self, o)

    def __rmul__(self, o: Any) -> Value:
        return apply("mul", o, self)

    def __truediv__(self, o: Any) -> Value:
        return apply("div", self, o)

    def __rtruediv__(self, o: Any) -> Value:
        return apply("div", o, self)

    def __pow__(self, o: Any) -> Value:
        return apply("pow", self, o)

    def __rpow__(self, o: Any) -> Value:
        return apply("pow", o, self)

    def __neg__(self) -> Value:
        return apply("neg", self)

    def __matmul__(self, o: Value) -> Value:
        return apply("matmul", self, o)

    def __lt__(self, o: Any) -> Value:
        return apply("lt", self, o)

    def __le__(self, o: Any) -> Value:
        return apply("le", self, o)

    def __gt__(self, o: Any) -> Value:
        return apply("gt", self, o)

    def __ge__(self, o: Any) -> Value:
        return apply("ge", self, o)


@dataclass
class Program:
    """A distributed workload: named inputs, operations, outputs and in-place updates of state."""

    name: str
    values: list[Value] = field(default_factory=list)
    inputs: dict[str, Value] = field(default_factory=dict)  # tensors and scalars, by name
    outputs: list[tuple[str, Value]] = field(default_factory=list)
    updates: dict[str, Value] = field(default_factory=dict)  # state input name -> update value
    groups: tuple[Group, ...] = (WORLD,)

    def __repr__(self) -> str:
        return f"<Program {self.name}: {len(self.values)} values>\n{self}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    # -- declaring inputs ---------------------------------------------------------------------
    def tensor(self, name: str, shape: Iterable[Dim], dtype: str = "float32",
               layout: Layout = Replicated, group: Group | None = None, init: str = "normal") -> Value:
        """Declare a tensor input held by every rank of `group` (the world by default) in `layout`.
        `init` tells random-input generators its domain: "normal", "positive" (e.g. Adam's v) or "unit"."""
        self._check_new_name(name)
        shape = tuple(shape)
        for d in shape:
            if not (isinstance(d, str) and d.isidentifier()) and not (isinstance(d, int) and d >= 0):
                raise ProgramError(f"tensor `{name}`: dimension {d!r} must be a non-negative int or a size name")
        try:
            dtype = canonical_dtype(dtype)
        except ValueError as e:
            raise ProgramError(f"tensor `{name}`: {e}") from None
        if init not in ("normal", "positive", "unit"):
            raise ProgramError(f"tensor `{name}`: init must be 'normal', 'positive' or 'unit', got {init!r}")
        group = group or (self.groups[0] if len(self.groups) == 1 else WORLD)
        if group not in self.groups:
            raise ProgramError(f"tensor `{name}`: process group `{group.name}` does not belong to this program")
        layout = bind_layout(layout, group, shape, f"tensor `{name}`")
        v = self._add("input", (), {"init": init}, dtype, shape, layout, group, name=name)
        self.inputs[name] = v
        return v

    def scalar(self, name: str, dtype: str = "float32", default: float | None = None) -> Value:
        """Declare a named runtime scalar (learning rate, step), the same on every rank."""
        self._check_new_name(name)
        v = self._add("scalar", (), {"default": default}, canonical_dtype(dtype), (), Replicated, None, name=name)
        self.inputs[name] = v
        return v

    def scalars(self, names: str) -> tuple[Value, ...]:
        """Declare several float32 scalars from a space-separated list of names."""
        return tuple(self.scalar(n) for n in names.split())

    def mesh(self, **axes: int) -> Mesh:
        """Lay the world out as a mesh of named axes, e.g. `p.mesh(dp=2, tp=2)` (world rank r at the row-major
        coordinates of r; the last axis varies fastest). Declared before any tensor."""
        if len(self.groups) > 1:
            raise ProgramError(f"program `{self.name}` splits the world into pipeline stages; it cannot also be a mesh")
        if self.values:
            raise ProgramError(f"program `{self.name}`: declare the mesh before any tensor or scalar")
        if self.groups[0].mesh is not None:
            raise ProgramError(f"program `{self.name}` already has the mesh {self.groups[0].mesh}")
        mesh = Mesh(tuple(axes), tuple(axes.values()))
        self.groups = (Group("world", 0, 1, mesh),)
        return mesh

    def like(self) -> Program:
        """An empty program with this one's name and process groups (rewrites build into it)."""
        new = Program(self.name)
        new.groups = self.groups
        return new

    def check_world(self, world_size: int) -> None:
        """ProgramError unless the program runs on `world_size` ranks: its groups split the world, fit their
        meshes, and every value's shares and weights have one entry per rank along their axis."""
        for g in self.groups:
            g.ranks(world_size)
        for v in self.values:
            if v.group is None:
                continue
            for what, (axis, n) in shares_of(v).items():
                size = v.group.axis_size(world_size, axis)
                if n != size:
                    where = f"axis `{axis}`" if axis else f"process group `{v.group.name}`"
                    raise ProgramError(f"`{v.name}` has {what} for {n} ranks, but {where} has {size} ranks at "
                                       f"world size {world_size}")

    def pipeline(self, stages: int) -> tuple[Group, ...]:
        """Split the world into `stages` equal consecutive process groups (pipeline stages)."""
        if self.groups[0].mesh is not None:
            raise ProgramError(f"program `{self.name}` is a mesh; it cannot also split into pipeline stages")
        if len(self.groups) > 1:
            raise ProgramError(f"program `{self.name}` already splits the world into {len(self.groups)} stages")
        if stages < 1:
            raise ProgramError(f"pipeline needs at least one stage, got {stages}")
        self.groups = tuple(Group(f"stage{i}", i, stages) for i in range(stages))
        return self.groups

    # -- results ------------------------------------------------------------------------------
    def update(self, state: Value, value: Any) -> Value:
        """Write `value` into the state input `state` in place; returns the updated value."""
        return apply("update", state, value)

    def output(self, value: Value, name: str | None = None) -> Value:
        """Mark `value` as a result of the program."""
        if not isinstance(value, Value) or value.program is not self:
            raise ProgramError(f"program `{self.name}`: output must be a value of this program, got {value!r}")
        name = name or f"out{len(self.outputs)}"
        if any(n == name for n, _ in self.outputs):
            raise ProgramError(f"program `{self.name}`: two outputs are named `{name}`")
        self.outputs.append((name, value))
        return value

    # -- queries ------------------------------------------------------------------------------
    @property
    def tensor_inputs(self) -> list[Value]:
        return [v for v in self.inputs.values() if v.op == "input"]

    @property
    def scalar_inputs(self) -> list[Value]:
        return [v for v in self.inputs.values() if v.op == "scalar"]

    def users(self) -> dict[Value, list[Value]]:
        """Map each value to the values that read it (in program order)."""
        out: dict[Value, list[Value]] = {v: [] for v in self.values}
        for v in self.values:
            for a in v.args:
                out[a].append(v)
        return out

    def size_names(self) -> list[str]:
        """Symbolic size names used by the program's shapes (its inputs', and an all_to_all_v's `rows`), in first-use
        order."""
        seen: list[str] = []
        for v in self.values:
            for d in v.shape:
                if isinstance(d, str) and d not in seen:
                    seen.append(d)
        return seen

    def __str__(self) -> str:
        return format_program(self)

    def fingerprint(self) -> str:
        return fingerprint(self)

    # -- construction internals ---------------------------------------------------------------
    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise ProgramError(f"program `{self.name}`: input name {name!r} must be an identifier")
        if name in self.inputs:
            raise ProgramError(f"program `{self.name}`: an input named `{name}` already exists")

    def _add(self, op: str, args: tuple[Value, ...], attrs: Mapping[str, Any], dtype: str, shape: Shape,
             layout: Layout, group: Group | None, name: str | None = None, loc: str | None = None) -> Value:
        vid = len(self.values)
        v = Value(self, vid, op, tuple(args), dict(attrs), dtype, tuple(shape), layout, group,
                  name or f"%{vid}", loc if loc is not None else user_location())
        self.values.append(v)
        return v


def shares_of(v: Value) -> dict[str, tuple[str | None, int]]:
    """What in `v` counts ranks along an axis: {'shares' / 'weights': (axis, number of entries)}."""
    out: dict[str, tuple[str | None, int]] = {}
    axes = v.axes
    for axis, p in zip(axes, placements(v.layout, len(axes))):
        if p.is_sliced and p.shares is not None:
            out["shares"] = (axis, len(p.shares))
    if v.attrs.get("weights") is not None:
        out["weights"] = (v.attrs.get("axis"), len(v.attrs["weights"]))
    return out


def bind_layout(layout: Any, group: Group, shape: tuple, what: str) -> Layout:
    """`layout` bound to `group`'s mesh: a placement per axis (a mesh layout on a mesh of several axes, a bare
    placement otherwise), sliced dims counted from 0 and within the tensor's dims; ProgramError otherwise."""
    mesh = group.mesh
    axes = mesh.axes if mesh is not None else (None,)
    if isinstance(layout, dict):
        layout = MeshLayout(**layout)
    elif isinstance(layout, tuple | list):
        layout = MeshLayout(*layout)
    if not isinstance(layout, Layout):
        raise ProgramError(f"{what}: layout must be cw.Replicated, cw.Local, cw.Sliced(dim) or cw.Layout(...) per "
                           f"mesh axis, got {layout!r}")
    if isinstance(layout, MeshLayout):
        if mesh is None:
            raise ProgramError(f"{what}: {layout!r} gives a placement per mesh axis, but the program has no mesh "
                               "(declare one with p.mesh(...), or use a single placement)")
        if layout.axes is None:
            if len(layout.placements) != len(axes):
                raise ProgramError(f"{what}: {layout!r} has {len(layout.placements)} placements for the "
                                   f"{len(axes)} axes of the mesh {mesh}")
            given = dict(zip(axes, layout.placements))
        else:
            given = dict(zip(layout.axes, layout.placements))
            for a in given:
                mesh.index(a)
        chosen = [given.get(a, Replicated) for a in axes]
    elif layout.is_sliced and len(axes) > 1:
        raise ProgramError(f"{what}: on the mesh {mesh}, say which axis slices it, e.g. "
                           f"cw.Layout({axes[-1]}={layout!r})")
    else:
        chosen = [layout] * len(axes)
    bound = []
    for a, p in zip(axes, chosen):
        if p.is_sliced:
            d = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= d < len(shape):
                raise ProgramError(f"{what}: {p!r} is out of range for a {len(shape)}-dim tensor {format_shape(shape)}")
            if p.shares is not None and mesh is not None and len(p.shares) != mesh.shape[mesh.index(a)]:
                raise ProgramError(f"{what}: {p!r} has {len(p.shares)} shares for the "
                                   f"{mesh.shape[mesh.index(a)]} ranks of axis `{a}`")
            p = Sliced(d, p.shares)
        bound.append(p)
    return make_layout(group, bound)


def make_layout(group: Group | None, per_axis: list | tuple) -> Layout:
    """The layout with one placement per axis of `group`'s mesh (a bare placement without a mesh of several)."""
    mesh = group.mesh if group is not None else None
    if mesh is None or len(mesh.axes) == 1:
        return per_axis[0]
    return MeshLayout(**dict(zip(mesh.axes, per_axis)))
