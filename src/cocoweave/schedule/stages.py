"""Stages: how a program's operations group into the steps a backend runs, in order.

A stage kind is one class, defined here once and used by schedules and plans alike: in a Schedule a
stage's `values` are value names (stable handles across rewrites); `plan.lower` resolves them to the
program's Values and fills in what every consumer of a Plan needs (`live_outs`, flattened chunk parts).

The base partition is greedy: every ready communication or matmul runs as its own stage; then all
computations that are ready run together as one compute stage; repeat. `fuse`, `overlap` and
`set_algorithm` then merge or annotate consecutive stages (checked here). Scalar-only arithmetic runs on
the host and is no stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from .. import collectives
from ..errors import ScheduleError
from ..ir import registry as R
from ..ir.graph import Program, Value
from ..ir.layout import placements
from ..ir.ops import batch_dims
from . import rows
from .rewrite import axis_of, on_axis

COMPUTE_OPS = R.names(*R.COMPUTE_GROUPS)
ELEMENTWISE_OPS = R.names(*R.ELEMENTWISE_GROUPS)
# How a communication stage moves its data, and where each way is legal: the table of collective algorithms
# (cocoweave.collectives).


@dataclass(frozen=True)
class Stage:
    """One step of a schedule or plan. `values`: the names (Schedule) or Values (Plan) it computes, in program
    order. `live_outs`: filled by plan.lower — the values read after the stage or kept as results."""

    values: tuple[Any, ...]
    live_outs: tuple[Any, ...] = ()
    kind: ClassVar[str] = ""

    @property
    def anchor(self) -> str:
        """The stage's handle: the name of its first value."""
        return _name(self.values[0])

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(_name(v) for v in self.values)

    @property
    def label(self) -> str:
        raise NotImplementedError

    def reads(self) -> list[Value]:
        """(Plan) Values from outside the stage that it reads: its input buffers."""
        inside = {id(v) for v in self.values}
        seen: dict[int, Value] = {}
        for v in self.values:
            for a in v.args:
                a = a.args[1] if a.op == "update" else a  # an updated state reads as its new value
                if id(a) not in inside and not a.is_scalar:
                    seen.setdefault(id(a), a)
        return list(seen.values())


def _name(v: Any) -> str:
    return v if isinstance(v, str) else v.name


@dataclass(frozen=True)
class Compute(Stage):
    """Computations: one fused loop (a generated kernel) when `fused`, else one torch op per operation."""

    fused: bool = False
    kind: ClassVar[str] = "compute"

    @property
    def label(self) -> str:
        return "C" if self.fused else "c"


@dataclass(frozen=True)
class MatMul(Stage):
    """One matrix multiplication."""

    kind: ClassVar[str] = "matmul"

    @property
    def label(self) -> str:
        return "MM"


@dataclass(frozen=True)
class Collective(Stage):
    """One collective (`op`: all_reduce, reduce_scatter, all_gather, broadcast, reduce) over its value's process
    group, on collective algorithm `algorithm` ("library": torch.distributed's call; "ring": point to point)."""

    op: str = ""
    algorithm: str = "library"
    kind: ClassVar[str] = "collective"

    @property
    def label(self) -> str:
        return collectives.kinds.token(self.op) + ("" if self.algorithm == "library" else f"@{self.algorithm}")


@dataclass(frozen=True)
class P2P(Stage):
    """Send to the next process group: group rank i of the sender's group sends to group rank i of the other
    ("library": torch.distributed's send; "shm": through shared memory)."""

    algorithm: str = "library"
    kind: ClassVar[str] = "p2p"

    @property
    def label(self) -> str:
        return "P2P" + ("" if self.algorithm == "library" else f"@{self.algorithm}")


@dataclass(frozen=True)
class FusedCollective(Stage):
    """ReduceScatter + computation + AllGathers as one stage (`parts`). On the ring, the computation is applied
    to each piece of the reduce-scatter as soon as it is fully reduced (CoCoNet's fused ring)."""

    parts: tuple[Stage, ...] = ()
    algorithm: str = "library"
    kind: ClassVar[str] = "fused"

    @property
    def label(self) -> str:
        return f"fuse({join_labels(self.parts)})" + ("" if self.algorithm == "library" else f"@{self.algorithm}")

    @property
    def reduce_scatter(self) -> Any:
        return self.parts[0].values[0]

    @property
    def kernel(self) -> Compute | None:
        return next((p for p in self.parts if isinstance(p, Compute)), None)

    @property
    def all_gathers(self) -> list[Any]:
        return [p.values[0] for p in self.parts[1:] if isinstance(p, Collective)]


@dataclass(frozen=True)
class Overlap(Stage):
    """A producer/consumer chain of `parts` run in `chunks` chunks along dimension `chunk_dim` of its values, so
    that chunk i's communication overlaps chunk i+1's computation. In a Plan, a fused collective among the parts
    is flattened into its RS, C and AG parts (each collective can then be in flight while another chunk
    computes)."""

    parts: tuple[Stage, ...] = ()
    chunks: int = 2
    chunk_dim: int = 0
    kind: ClassVar[str] = "overlap"

    @property
    def label(self) -> str:
        return f"ol({','.join(p.label for p in self.parts)},{self.chunks})"


@dataclass(frozen=True)
class RowChunks(Overlap):
    """An Overlap of a chain through all_to_all_v (a dropless MoE's dispatch -> expert GEMMs -> combine) in
    `chunks` row-set chunks decided at run time (schedule/rows.py): chunk k takes of every rank's segment of rows
    its k-th K-th, so chunk k+1's exchange is in flight while chunk k's GEMMs run (where the exchanges' algorithm
    overlaps: the library's). `chunk_dim` is 0 (rows); `algorithm` is its exchanges' ("library", or "shm" through
    shared memory), read from its exchange parts, which carry it."""

    kind: ClassVar[str] = "row_chunks"

    @property
    def algorithm(self) -> str:
        return next((p.algorithm for p in self.parts if isinstance(p, Collective)), collectives.DEFAULT)


def join_labels(stages: tuple[Stage, ...] | list[Stage]) -> str:
    """Labels joined by '-', runs of equal communication labels written once (AG-AG-AG -> AG)."""
    out: list[str] = []
    for s in stages:
        lab = s.label
        if not (out and out[-1] == lab and isinstance(s, Collective)):
            out.append(lab)
    return "-".join(out)


def value(program: Program, name: str) -> Value:
    for v in program.values:
        if v.name == name:
            return v
    raise KeyError(name)


def make_stage(v: Value) -> Stage | None:
    """The one-value stage of v, or None for inputs, constants, host scalars and updates (no stage)."""
    if v.op in ("input", "scalar", "const", "update") or v.is_scalar:
        return None
    if v.op in COMPUTE_OPS:
        return Compute((v.name,))
    if R.group(v.op) == R.MATMUL:
        return MatMul((v.name,))
    if v.op == "send":
        return P2P((v.name,))
    return Collective((v.name,), op=v.op)


def base_stages(program: Program) -> list[Stage]:
    """Greedy partition: every ready communication or matmul first, each its own stage (so it can
    start as early as possible); then all computations that are ready, together; repeat."""
    kinds = {id(v): make_stage(v) for v in program.values}
    pending = [v for v in program.values if kinds[id(v)] is not None]
    done = {id(v) for v in program.values if kinds[id(v)] is None and v.op != "update"}
    stages: list[Stage] = []

    def ready(v: Value) -> bool:
        return all(id(a) in done or (a.op == "update" and id(a.args[1]) in done) for a in v.args)

    while pending:
        comm = [v for v in pending if not isinstance(kinds[id(v)], Compute) and ready(v)]
        for v in comm:
            stages.append(kinds[id(v)])
            done.add(id(v))
        group: list[Value] = []
        progress = not comm
        while progress:
            progress = False
            for v in pending:
                if isinstance(kinds[id(v)], Compute) and id(v) not in done and ready(v):
                    group.append(v)
                    done.add(id(v))
                    progress = True
        if group:
            stages.append(Compute(tuple(v.name for v in sorted(group, key=lambda x: x.id))))
        if not comm and not group:
            raise AssertionError(f"program {program.name!r} has a cycle or an unreachable value")
        pending = [v for v in pending if id(v) not in done]
    return stages


def locate(stages: list[Stage], ref: str | Stage) -> int:
    """Index of the stage with handle `ref` (a Stage, or the name of any value in it)."""
    name = ref.anchor if isinstance(ref, Stage) else ref
    for i, s in enumerate(stages):
        if name in s.names:
            return i
    raise ScheduleError(f"no stage computes `{name}`; the stages start with: "
                        + ", ".join(f"`{s.anchor}`" for s in stages))


def _consecutive(stages: list[Stage], refs: tuple[str | Stage, ...], verb: str) -> list[int]:
    if not refs:
        raise ScheduleError(f"{verb} needs at least one stage")
    idx = sorted({locate(stages, r) for r in refs})
    if idx != list(range(idx[0], idx[-1] + 1)):
        raise ScheduleError(f"cannot {verb} stages " + ", ".join(f"`{stages[i].anchor}`" for i in idx)
                            + ": they are not consecutive")
    return idx


def fuse(program: Program, stages: list[Stage], refs: tuple[str | Stage, ...]) -> list[Stage]:
    """Merge consecutive stages: computations into one kernel, or reduce_scatter + computation +
    all_gather into one fused collective stage."""
    idx = _consecutive(stages, refs, "fuse")
    group = [stages[i] for i in idx]
    _library_only(group, "fuse")
    if all(isinstance(s, Compute) for s in group):
        merged: Stage = Compute(tuple(n for s in group for n in s.values), fused=True)
    else:
        merged = _fused_collective(program, group)
    return stages[:idx[0]] + [merged] + stages[idx[-1] + 1:]


def _fused_collective(program: Program, group: list[Stage]) -> Stage:
    ops_ = [s.op if isinstance(s, Collective) else s.kind for s in group]
    n_ag = 0
    while n_ag < len(ops_) and ops_[len(ops_) - 1 - n_ag] == "all_gather":
        n_ag += 1
    body = ops_[1:len(ops_) - n_ag]
    if ops_[0] != "reduce_scatter" or n_ag == 0 or body != ["compute"]:
        names = "-".join(s.label for s in group)
        raise ScheduleError(f"cannot fuse {names}: only computations, or a reduce_scatter followed by "
                            "computation and all_gathers (RS-C-AG), fuse into one stage")
    rs = value(program, group[0].anchor)
    for s in group[len(group) - n_ag:]:
        ag = value(program, s.anchor)
        if ag.attrs["dim"] != rs.attrs["dim"] or ag.group != rs.group or ag.attrs.get("axis") != rs.attrs.get("axis"):
            raise ScheduleError(f"cannot fuse `{ag.name}` with `{rs.name}`: it gathers along another dimension, "
                                "group or mesh axis than the reduce_scatter scatters")
    parts = tuple(replace(s, fused=True) if isinstance(s, Compute) else s for s in group)
    return FusedCollective(tuple(n for s in group for n in s.values), parts=parts)


def overlap(program: Program, stages: list[Stage], refs: tuple[str | Stage, ...], chunks: int) -> list[Stage]:
    """Run a producer/consumer chain of consecutive stages (each reading what one before it makes) in `chunks`
    chunks so that chunk i's communication overlaps chunk i+1's computation."""
    if not isinstance(chunks, int) or not 2 <= chunks <= 64:
        raise ScheduleError(f"overlap needs 2 to 64 chunks, got {chunks!r}")
    idx = _consecutive(stages, refs, "overlap")
    group = [stages[i] for i in idx]
    _library_only(group, "overlap")
    names = "-".join(s.label for s in group)
    if len(group) < 2:
        raise ScheduleError(f"cannot overlap {names}: overlap needs a chain of at least two stages")
    for k, nxt in enumerate(group[1:], 1):  # each stage reads what one before it in the chain makes
        made = {m for s in group[:k] for m in s.names}
        if not any(a.name in made for n in nxt.names for a in value(program, n).args):
            raise ScheduleError(f"cannot overlap {names}: `{nxt.anchor}` does not read what `{group[k - 1].anchor}` "
                                "or a stage before it makes")
    members = [n for s in group for n in s.names]
    vals = [value(program, n) for n in members]
    if rows.chainable(vals):
        rows.analyse(vals, set(), names)  # refuses what row-set chunks cannot run (what is read after: lowering's)
        return stages[:idx[0]] + [RowChunks(tuple(members), parts=tuple(group), chunks=chunks)] + \
            stages[idx[-1] + 1:]
    dim = chunk_dim(vals, names)
    return stages[:idx[0]] + [Overlap(tuple(members), parts=tuple(group), chunks=chunks, chunk_dim=dim)] + \
        stages[idx[-1] + 1:]


def _library_only(group: list[Stage], verb: str) -> None:
    """Grouping comes before algorithm choices: a stage already on a non-library algorithm cannot join a group."""
    for s in group:
        algorithm = getattr(s, "algorithm", "library")
        if algorithm != "library":
            raise ScheduleError(f"cannot {verb} `{s.anchor}`: it already runs on the {algorithm} algorithm; "
                                f"{verb} first, then choose the algorithm of the resulting stage")


def set_algorithm(program: Program, stages: list[Stage], ref: str | Stage, algorithm: str) -> list[Stage]:
    """Run one collective stage (AR, RS, AG), fused RS-C-AG stage or P2P stage on `algorithm`, where the table of
    collective algorithms says it implements the stage's operations and reductions; an algorithm that fuses runs
    the computation piece by piece along the scattered dimension, so every computed value must be elementwise and
    sliced along that dimension."""
    try:
        entry = collectives.get(algorithm)
    except collectives.UnknownAlgorithmError as e:
        raise ScheduleError(str(e)) from None
    i = locate(stages, ref)
    s = stages[i]
    lab = s.label
    if isinstance(s, RowChunks):
        missing = next((v.op for v in map(lambda n: value(program, n), s.values) if R.is_communication(v.op)
                        and not entry.implements(v.op)), None)
        if missing is not None:
            raise ScheduleError(f"cannot run {lab} (`{s.anchor}`) as a {algorithm}: it has no {missing}")
        parts = tuple(replace(p, algorithm=algorithm) if isinstance(p, Collective) else p for p in s.parts)
        return stages[:i] + [replace(s, parts=parts)] + stages[i + 1:]
    if isinstance(s, P2P):
        if not entry.implements("send"):
            raise ScheduleError(f"cannot run {lab} (`{s.anchor}`) as a {algorithm}: it has no point-to-point send")
        return stages[:i] + [replace(s, algorithm=algorithm)] + stages[i + 1:]
    if not isinstance(s, Collective | FusedCollective):
        raise ScheduleError(f"cannot choose an algorithm for stage {lab} (`{s.anchor}`): only collective stages "
                            "(AR, RS, AG), fused RS-C-AG stages, P2P stages and row-chunked exchanges have one")
    head = value(program, s.anchor)
    ops = [value(program, p.anchor).op for p in (s.parts if isinstance(s, FusedCollective) else (s,))
           if isinstance(p, Collective)]
    missing = next((op for op in ops if not entry.implements(op)), None)
    if missing is not None:
        done = [op for op in entry.collectives if op not in ("send", collectives.FUSED)]
        raise ScheduleError(f"cannot run {lab} (`{s.anchor}`) as a {algorithm}: only {', '.join(done)} have one")
    op = head.attrs.get("op")
    if not entry.reduces(op):
        raise ScheduleError(f"cannot run {lab} (`{s.anchor}`) as a {algorithm}: it reduces with {op!r}, and a "
                            f"{algorithm} reduces with one of {', '.join(entry.reductions or ())}")
    if isinstance(s, FusedCollective) and entry.fuses:
        dim = head.attrs["dim"]
        axis, count = axis_of(head)
        for n in (n for p in s.parts if isinstance(p, Compute) for n in p.names):
            v = value(program, n)
            piecewise = v.op in ELEMENTWISE_OPS + ("slice",) and v.ndim == head.ndim
            at = on_axis(v, axis, count)
            if not piecewise or not at.is_sliced or at.dim != dim:
                raise ScheduleError(f"cannot run {lab} as a {algorithm}: `{v.name} = {v.op}(...)` is not an "
                                    f"elementwise value sliced along dimension {dim}, so it cannot be computed "
                                    "piece by piece as the ring reduces")
    return stages[:i] + [replace(s, algorithm=algorithm)] + stages[i + 1:]


def _axis_count(v: Value) -> int:
    mesh = v.group.mesh if v.group is not None else None
    return len(mesh.axes) if mesh is not None else 1


def chunk_dim(vals: list[Value], names: str) -> int:
    """A dimension every value of the chain `vals` can be cut along independently: not contracted by a
    matmul, not sliced or gathered by a collective, not reduced."""
    nd = vals[0].ndim
    banned: set[int] = set()
    for v in vals:
        if R.group(v.op) in (R.REDUCTION, R.NORMALISATION):
            raise ScheduleError(f"cannot overlap {names}: `{v.name} = {v.op}(...)` reduces across the chunks")
        kind = collectives.kinds.find(v.op)
        if kind is not None and not kind.chunkable:  # a send is chunked piece by piece
            raise ScheduleError(f"cannot overlap {names}: a {v.op} cannot be chunked")
        if v.op == "all_reduce" and v.attrs["op"] == "adasum":
            raise ScheduleError(f"cannot overlap {names}: adasum all_reduce `{v.name}` combines whole tensors "
                                "(its coefficients need every element), so it cannot be chunked")
    for v in vals:
        if v.ndim != nd:
            raise ScheduleError(f"cannot overlap {names}: `{v.name}` has {v.ndim} dimensions, the chain has {nd}")
        if v.op == "matmul":
            banned.add(nd - 1)
            banned |= set(batch_dims(v))  # its right operand is not cut into chunks
        for t in [v, *v.args]:
            if not t.is_scalar and t.ndim == nd:
                banned |= {p.dim for p in placements(t.layout, _axis_count(t)) if p.is_sliced}
        if v.op in ("reduce_scatter", "all_gather"):
            banned.add(v.attrs["dim"])
    for d in range(nd):
        size = vals[0].shape[d]
        if d not in banned and size != 1:
            return d
    raise ScheduleError(f"cannot overlap {names}: no dimension can be chunked (dimensions {sorted(banned)} are "
                        "sliced, gathered or contracted)")
