"""Every legal schedule of a program, by CoCoNet's recipe, deduplicated.

1. The program as written (eager computation: `c`).
2. Rewrites: none; split every AllReduce; split + reorder; + as_slice of the internal state
   (state whose new value other computations read, like Adam's m and v) and of all sliceable state.
3. Groupings on each rewrite: fuse every computation stage into one kernel (`C`); fuse
   ReduceScatter + computation + AllGather; overlap matmul -> collective (-> epilogue) chains,
   collective -> computation -> send chains and all_to_all -> matmul (-> ... -> collective) chains with 2, 4 or 8
   chunks; all_to_all_v -> matmul ... -> all_to_all_v chains (a dropless MoE's dispatch -> experts -> combine) in 2
   or 4 row-set chunks (schedule/rows.py), their exchanges on the library's or on every other algorithm offered
   that implements all_to_all_v (`@shm`).
4. Algorithms, as the table of collective algorithms (cocoweave.collectives) says for each one offered on the
   device: the program as written with its AllReduces on the ring (`AR@ring`), every fused
   ReduceScatter + computation + AllGather on CoCoNet's fused ring (`fuse(RS-C-AG)@ring`), and every fused
   schedule with all its communication through shared memory (`@shm`, for ranks of one host, on CPU tensors only:
   its segments are the host's memory, so a CUDA tensor would be copied to the host and back, or worse).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import collectives
from ..errors import ScheduleError
from ..ir.graph import Program
from . import rows
from .as_slice import sliced_dim
from .schedule import Schedule
from .stages import RowChunks, Stage, value
from .steps import Reorder, Split, Step

CHUNKS = (2, 4, 8)
ROW_CHUNKS = (2, 4)  # a dropless MoE's dispatch -> experts -> combine in row-set chunks (schedule/rows.py)


def _try(build: Callable[[], Schedule]) -> Schedule | None:
    try:
        return build()
    except ScheduleError:
        return None


def _rewrites(program: Program) -> list[Schedule]:
    """The program, then split, split + reorder and the as_slice variants, where legal."""
    out = [Schedule(program)]
    ars = [v.name for v in program.values if v.op == "all_reduce" and v.attrs["op"] != "adasum" and v.ndim > 0]
    if not ars:
        return out

    def split_all(reorder: bool) -> Schedule:
        s = Schedule(program)
        for ar in ars:
            _split(s, ar, reorder)
        return s

    split = _try(lambda: split_all(False))
    reordered = _try(lambda: split_all(True))
    out += [s for s in (split, reordered) if s is not None]
    if reordered is None:
        return out
    sliceable = [n for n in reordered.program.updates if _try_dim(reordered.program, n)]
    users = program.users()  # internal state: its new value is read by other computations (Adam's m, v)
    internal = [n for n in sliceable if users[program.updates[n]]]
    for names in ([internal] if internal and internal != sliceable else []) + ([sliceable] if sliceable else []):
        s = _try(lambda names=names: _with_slices(program, reordered.steps, names))
        if s is not None:
            out.append(s)
    return out


def _split(s: Schedule, ar: str, reorder: bool) -> None:
    """Split `ar` (and reorder its all_gather) along dimension 0; on a mesh of several axes, along the first
    dimension where that works (another axis may slice a dimension already, or the epilogue another one)."""
    mesh = value(s.program, ar).group.mesh
    dims = range(value(s.program, ar).ndim) if mesh is not None and len(mesh.axes) > 1 else (0,)
    for d in dims:
        try:
            s._apply(Split(ar, d), *([Reorder(f"{ar}.ag")] if reorder else []))
            return
        except ScheduleError:
            if d == dims[-1]:
                raise


def _try_dim(program: Program, name: str) -> bool:
    try:
        sliced_dim(program, name)
        return True
    except ScheduleError:
        return False


def _with_slices(program: Program, steps: list[Step], names: list[str]) -> Schedule:
    s = Schedule(program, steps)
    s.as_slice(*names)
    return s


def _fuse_computations(s: Schedule) -> Schedule:
    for stage in [x for x in s.stages if x.kind == "compute"]:
        s.fuse(stage)
    return s


def _fuse_collectives(s: Schedule) -> Schedule | None:
    """Fuse each RS, C, AG... run of stages into one stage; None if there is none."""
    stages, changed, i = s.stages, False, 0
    while i < len(stages):
        run = _rs_c_ag(s, stages, i)
        if run:
            s.fuse(*run)
            stages, changed = s.stages, True
        i += 1
    return s if changed else None


def _rs_c_ag(s: Schedule, stages: list[Stage], i: int) -> list[Stage] | None:
    op = lambda st: value(s.program, st.anchor).op  # noqa: E731
    if stages[i].kind != "collective" or op(stages[i]) != "reduce_scatter" or i + 2 >= len(stages):
        return None
    if stages[i + 1].kind != "compute":
        return None
    j = i + 2
    while j < len(stages) and stages[j].kind == "collective" and op(stages[j]) == "all_gather":
        j += 1
    return stages[i:j] if j > i + 2 else None


def _chains(s: Schedule) -> list[tuple[list[Stage], tuple[int, ...]]]:
    """Producer/consumer chains worth overlapping, each with the chunk counts to try: MM -> collective (-> C),
    collective -> C -> P2P, and an all_to_all -> MM chain through the matmuls and computations after it, up to and
    with the next collective (MoE's dispatch -> experts -> combine: the experts of one chunk of tokens run while the
    next chunk moves); for an all_to_all_v (the dropless experts), only the whole chain through a matmul to the next
    all_to_all_v, in row-set chunks (ROW_CHUNKS)."""
    st, out = s.stages, []

    def after_computations(i: int) -> int:
        """The index of the first stage after i that is not a matmul or a computation."""
        j = i + 1
        while j < len(st) and st[j].kind in ("matmul", "compute"):
            j += 1
        return j

    for i, x in enumerate(st):
        if rows.exchanges_rows(getattr(x, "op", "")):
            j = after_computations(i)
            if j < len(st) and rows.exchanges_rows(getattr(st[j], "op", "")) and \
                    any(y.kind == "matmul" for y in st[i + 1:j]):
                out.append((st[i:j + 1], ROW_CHUNKS))
            continue
        opens = (k := collectives.kinds.find(getattr(x, "op", ""))) is not None and k.opens_chain
        if opens and i + 1 < len(st) and st[i + 1].kind == "matmul":
            out.append((st[i:i + 2], CHUNKS))
            j = after_computations(i)
            if j < len(st) and st[j].kind == "collective":
                out.append((st[i:j + 1], CHUNKS))
        if x.kind == "matmul" and i + 1 < len(st) and st[i + 1].kind in ("collective", "fused"):
            out.append((st[i:i + 2], CHUNKS))
            if i + 2 < len(st) and st[i + 2].kind == "compute":
                out.append((st[i:i + 3], CHUNKS))
        if x.kind == "p2p" and i >= 2 and st[i - 1].kind == "compute" and st[i - 2].kind in ("collective", "fused"):
            out.append((st[i - 2:i + 1], CHUNKS))
    return out


def _row_algorithms(device: str) -> list[str]:
    """The algorithms other than the library's that a row-chunked chain's exchanges (all_to_all_v) move onto."""
    return [a.name for a in collectives.algorithms()
            if a.name != collectives.DEFAULT and a.offered(device) and a.implements("all_to_all_v")]


def shm_offered(device: str) -> bool:
    """Whether the shared-memory algorithm is offered for tensors on `device` ("cpu", "cuda:0", "meta"...): only in
    the host's memory, which its segments are."""
    return collectives.get("shm").offered(device)


def enumerate_schedules(program: Program, device: str = "cpu") -> list[Schedule]:
    """Every legal schedule of `program` by CoCoNet's recipe, deduplicated, the program as written first; for
    tensors on `device` (each algorithm where the table offers it: no `@shm` schedule off the CPU)."""
    found: dict[str, Schedule] = {}

    def add(s: Schedule | None) -> None:
        if s is not None:
            found.setdefault(s.name, s)

    row_algorithms = _row_algorithms(device)
    for rewrite in _rewrites(program):
        if not rewrite.steps:
            add(rewrite)  # the program as written: the baseline
        steps = rewrite.steps
        bases = [_fuse_computations(Schedule(program, steps))]
        bases.append(_try(lambda steps=steps: _fuse_collectives(_fuse_computations(Schedule(program, steps)))))
        for base in [b for b in bases if b is not None]:
            add(base)
            for chain, counts in _chains(base):
                for n in counts:
                    refs = [c.anchor for c in chain]
                    ol = _try(lambda base=base, refs=refs, n=n: _overlapped(program, base, refs, n))
                    add(ol)
                    if ol is not None and any(isinstance(x, RowChunks) for x in ol.stages):
                        for algorithm in row_algorithms:
                            add(_on(program, ol, (RowChunks.kind,), algorithm))
        on = {"written": None if steps else bases[0], "each": bases[0], "fused": bases[1]}
        for algorithm in [a for a in collectives.algorithms() if a.offered(device)]:
            for base, kinds in algorithm.enumerated:
                if on[base] is not None:
                    add(_on(program, on[base], kinds, algorithm.name))
    return list(found.values())


_ENUMERATED: dict[str, list[Schedule]] = {}


def schedules_of(program: Program) -> list[Schedule]:
    """enumerate_schedules, memoised by program fingerprint (a model's layers of one shape share them) and the
    table of collective algorithms' generation."""
    key = f"{program.fingerprint()}/{collectives.generation()}"
    if key not in _ENUMERATED:
        _ENUMERATED[key] = enumerate_schedules(program)
    return _ENUMERATED[key]


def _on(program: Program, base: Schedule, kinds: tuple[str, ...], algorithm: str) -> Schedule | None:
    """`base` with every stage of `kinds` that can run on `algorithm` moved onto it; None if none can."""
    s, changed = Schedule(program, base.steps), False
    for stage in [x for x in s.stages if x.kind in kinds]:
        changed |= _try(lambda stage=stage: _algorithm_step(s, stage, algorithm)) is not None
    return s if changed else None


def _algorithm_step(s: Schedule, stage: Stage, algorithm: str) -> Schedule:
    s.algorithm(stage, algorithm)
    return s


def _overlapped(program: Program, base: Schedule, refs: list[str], chunks: int) -> Schedule:
    s = Schedule(program, base.steps)
    s.overlap(*refs, chunks=chunks)
    return s
