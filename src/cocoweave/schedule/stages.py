"""Stages: how a program's operations group into the steps a backend runs, in order.

The base partition is greedy: all computations that are ready run together as one compute stage;
then every ready communication or matmul runs as its own stage; repeat. `fuse` and `overlap` then
merge consecutive stages (checked here). Scalar-only arithmetic runs on the host and is no stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ScheduleError
from ..ir import ops
from ..ir.graph import Program, Value

COMPUTE_OPS = ops.ELEMENTWISE + ops.REDUCTIONS + ("layer_norm", "slice")
COMM_TOKENS = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC",
               "reduce": "R", "send": "P2P", "matmul": "MM"}
CHUNKABLE_COMM = ("all_reduce", "reduce_scatter", "all_gather", "send")
ALGORITHMS = ("library", "ring")  # torch.distributed's call; a ring over point-to-point messages
RING_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
RING_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Stage:
    """One step of a schedule: `kind` is compute, matmul, collective, p2p, fused (RS + compute + AG
    as one stage) or overlap (a chunked producer/consumer chain of `parts`)."""

    kind: str
    values: tuple[str, ...]  # names of the program values it computes, in program order
    fused: bool = False  # compute: one generated kernel instead of one torch op per operation
    parts: tuple[Stage, ...] = ()
    chunks: int = 1
    chunk_dim: int = -1
    algorithm: str = "library"  # collective and fused stages: how the communication runs (ALGORITHMS)

    @property
    def anchor(self) -> str:
        """The stage's handle: the name of its first value."""
        return self.values[0]

    def label(self, program: Program) -> str:
        """Short name: C (fused computation), c (eager ops), MM, AR, RS, AG, P2P, fuse(...), ol(...);
        a collective or fused stage on a non-default algorithm ends in @algorithm (AR@ring)."""
        at = "" if self.algorithm == "library" else f"@{self.algorithm}"
        if self.kind == "compute":
            return "C" if self.fused else "c"
        if self.kind in ("matmul", "collective", "p2p"):
            return COMM_TOKENS[value(program, self.anchor).op] + at
        inner = join_labels(program, self.parts)
        if self.kind == "fused":
            return f"fuse({inner}){at}"
        return f"ol({','.join(p.label(program) for p in self.parts)},{self.chunks})"


def join_labels(program: Program, stages: tuple[Stage, ...] | list[Stage]) -> str:
    """Labels joined by '-', runs of equal communication labels written once (AG-AG-AG -> AG)."""
    out: list[str] = []
    for s in stages:
        lab = s.label(program)
        if not (out and out[-1] == lab and s.kind == "collective"):
            out.append(lab)
    return "-".join(out)


def value(program: Program, name: str) -> Value:
    for v in program.values:
        if v.name == name:
            return v
    raise KeyError(name)


def kind_of(v: Value) -> str | None:
    """Stage kind of a value, or None for inputs, constants, host scalars and updates."""
    if v.op in ("input", "scalar", "const", "update") or v.is_scalar:
        return None
    if v.op in COMPUTE_OPS:
        return "compute"
    if v.op == "matmul":
        return "matmul"
    if v.op == "send":
        return "p2p"
    return "collective"


def base_stages(program: Program) -> list[Stage]:
    """Greedy partition: every ready communication or matmul first, each its own stage (so it can
    start as early as possible); then all computations that are ready, together; repeat."""
    pending = [v for v in program.values if kind_of(v) is not None]
    done = {id(v) for v in program.values if kind_of(v) is None and v.op != "update"}
    stages: list[Stage] = []

    def ready(v: Value) -> bool:
        return all(id(a) in done or (a.op == "update" and id(a.args[1]) in done) for a in v.args)

    while pending:
        comm = [v for v in pending if kind_of(v) != "compute" and ready(v)]
        for v in comm:
            stages.append(Stage(kind_of(v), (v.name,)))
            done.add(id(v))
        group: list[Value] = []
        progress = not comm
        while progress:
            progress = False
            for v in pending:
                if kind_of(v) == "compute" and id(v) not in done and ready(v):
                    group.append(v)
                    done.add(id(v))
                    progress = True
        if group:
            stages.append(Stage("compute", tuple(v.name for v in sorted(group, key=lambda x: x.id))))
        if not comm and not group:
            raise AssertionError(f"program {program.name!r} has a cycle or an unreachable value")
        pending = [v for v in pending if id(v) not in done]
    return stages


def locate(stages: list[Stage], ref: str | Stage) -> int:
    """Index of the stage with handle `ref` (a Stage, or the name of any value in it)."""
    name = ref.anchor if isinstance(ref, Stage) else ref
    for i, s in enumerate(stages):
        if name in s.values:
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
    if all(s.kind == "compute" for s in group):
        merged = Stage("compute", tuple(n for s in group for n in s.values), fused=True)
    else:
        merged = _fused_collective(program, group)
    return stages[:idx[0]] + [merged] + stages[idx[-1] + 1:]


def _fused_collective(program: Program, group: list[Stage]) -> Stage:
    ops_ = [value(program, s.anchor).op if s.kind == "collective" else s.kind for s in group]
    n_ag = 0
    while n_ag < len(ops_) and ops_[len(ops_) - 1 - n_ag] == "all_gather":
        n_ag += 1
    body = ops_[1:len(ops_) - n_ag]
    if ops_[0] != "reduce_scatter" or n_ag == 0 or body != ["compute"]:
        names = "-".join(s.label(program) for s in group)
        raise ScheduleError(f"cannot fuse {names}: only computations, or a reduce_scatter followed by "
                            "computation and all_gathers (RS-C-AG), fuse into one stage")
    rs = value(program, group[0].anchor)
    for s in group[len(group) - n_ag:]:
        ag = value(program, s.anchor)
        if ag.attrs["dim"] != rs.attrs["dim"] or ag.group != rs.group:
            raise ScheduleError(f"cannot fuse `{ag.name}` with `{rs.name}`: it gathers along another dimension "
                                "or group than the reduce_scatter scatters")
    parts = tuple(replace(s, fused=True) if s.kind == "compute" else s for s in group)
    return Stage("fused", tuple(n for s in group for n in s.values), parts=parts)


def overlap(program: Program, stages: list[Stage], refs: tuple[str | Stage, ...], chunks: int) -> list[Stage]:
    """Run a producer/consumer chain of consecutive stages in `chunks` chunks so that chunk i's
    communication overlaps chunk i+1's computation."""
    if not isinstance(chunks, int) or not 2 <= chunks <= 64:
        raise ScheduleError(f"overlap needs 2 to 64 chunks, got {chunks!r}")
    idx = _consecutive(stages, refs, "overlap")
    group = [stages[i] for i in idx]
    _library_only(group, "overlap")
    names = "-".join(s.label(program) for s in group)
    if len(group) < 2:
        raise ScheduleError(f"cannot overlap {names}: overlap needs a chain of at least two stages")
    members = {n for s in group for n in s.values}
    for prev, nxt in zip(group, group[1:]):
        if not any(a.name in prev.values for n in nxt.values for a in value(program, n).args):
            raise ScheduleError(f"cannot overlap {names}: `{nxt.anchor}` does not read what `{prev.anchor}` makes")
    dim = chunk_dim(program, group, members, names)
    return stages[:idx[0]] + [Stage("overlap", tuple(members_in_order(group)), parts=tuple(group),
                                    chunks=chunks, chunk_dim=dim)] + stages[idx[-1] + 1:]


def _library_only(group: list[Stage], verb: str) -> None:
    """Grouping comes before algorithm choices: a stage already on a non-library algorithm cannot join a group."""
    for s in group:
        if s.algorithm != "library":
            raise ScheduleError(f"cannot {verb} `{s.anchor}`: it already runs on the {s.algorithm} algorithm; "
                                f"{verb} first, then choose the algorithm of the resulting stage")


def set_algorithm(program: Program, stages: list[Stage], ref: str | Stage, algorithm: str) -> list[Stage]:
    """Run one collective stage (AR, RS, AG) or fused RS-C-AG stage on `algorithm`. The ring needs a
    sum/avg/max/min reduction, and a fused ring applies its computation piece by piece along the
    scattered dimension, so every computed value must be elementwise and sliced along that dimension."""
    if algorithm not in ALGORITHMS:
        raise ScheduleError(f"unknown collective algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    i = locate(stages, ref)
    s = stages[i]
    lab = s.label(program)
    if s.kind not in ("collective", "fused"):
        raise ScheduleError(f"cannot choose an algorithm for stage {lab} (`{s.anchor}`): only collective stages "
                            "(AR, RS, AG) and fused RS-C-AG stages have one")
    head = value(program, s.anchor)
    if head.op not in RING_COLLECTIVES and algorithm != "library":
        raise ScheduleError(f"cannot run {lab} (`{s.anchor}`) as a {algorithm}: only {', '.join(RING_COLLECTIVES)} "
                            "have one")
    op = head.attrs.get("op")
    if op is not None and op not in RING_OPS and algorithm != "library":
        raise ScheduleError(f"cannot run {lab} (`{s.anchor}`) as a {algorithm}: it reduces with {op!r}, and a ring "
                            f"reduces with one of {', '.join(RING_OPS)}")
    if s.kind == "fused" and algorithm != "library":
        dim = head.attrs["dim"]
        for n in (n for p in s.parts if p.kind == "compute" for n in p.values):
            v = value(program, n)
            piecewise = v.op in ops.ELEMENTWISE + ("slice",) and v.ndim == head.ndim
            if not piecewise or not v.layout.is_sliced or v.layout.dim != dim:
                raise ScheduleError(f"cannot run {lab} as a {algorithm}: `{v.name} = {v.op}(...)` is not an "
                                    f"elementwise value sliced along dimension {dim}, so it cannot be computed "
                                    "piece by piece as the ring reduces")
    return stages[:i] + [replace(s, algorithm=algorithm)] + stages[i + 1:]


def members_in_order(group: list[Stage]) -> list[str]:
    return [n for s in group for n in s.values]


def chunk_dim(program: Program, group: list[Stage], members: set[str], names: str) -> int:
    """A dimension every value of the chain can be cut along independently: not contracted by a
    matmul, not sliced or gathered by a collective, not reduced."""
    vals = [value(program, n) for n in members]
    nd = vals[0].ndim
    banned: set[int] = set()
    for v in vals:
        if v.op in ops.REDUCTIONS or v.op == "layer_norm":
            raise ScheduleError(f"cannot overlap {names}: `{v.name} = {v.op}(...)` reduces across the chunks")
        if v.op in ops.COLLECTIVES and v.op not in CHUNKABLE_COMM:
            raise ScheduleError(f"cannot overlap {names}: a {v.op} cannot be chunked")
        if v.op == "all_reduce" and v.attrs["op"] == "adasum":
            raise ScheduleError(f"cannot overlap {names}: adasum all_reduce `{v.name}` combines whole tensors "
                                "(its coefficients need every element), so it cannot be chunked")
    for v in vals:
        if v.ndim != nd:
            raise ScheduleError(f"cannot overlap {names}: `{v.name}` has {v.ndim} dimensions, the chain has {nd}")
        if v.op == "matmul":
            banned.add(nd - 1)
        for t in [v, *v.args]:
            if not t.is_scalar and t.layout.is_sliced and t.ndim == nd:
                banned.add(t.layout.dim)
        if v.op in ("reduce_scatter", "all_gather"):
            banned.add(v.attrs["dim"])
    for d in range(nd):
        size = vals[0].shape[d]
        if d not in banned and size != 1:
            return d
    raise ScheduleError(f"cannot overlap {names}: no dimension can be chunked (dimensions {sorted(banned)} are "
                        "sliced, gathered or contracted)")
