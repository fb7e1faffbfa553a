"""The Plan's memory decisions for one rank, made once: which value is computed over a temporary of its stage,
which all-gather fills a state tensor directly (and may stay in flight), which state a fused stage writes over,
which fused results land in this rank's part of a state tensor a shared-memory all-gather fills, and which
executable buffers can hold an output. Code generators and the executable read these; none decides them."""

from __future__ import annotations

from dataclasses import dataclass

from .. import collectives
from ..ir import registry as R
from ..ir.graph import Value
from ..schedule.stages import Compute, FusedCollective, Overlap, Stage
from .plan import Plan
from .view import RankView

# ops whose result may be computed over an operand (`a.add_(b)`; silu_grad over its dy) / whose results are fresh
# tensors either way
OVER_OPS = ("add", "sub", "mul", "div", "silu_grad")
FRESH_OPS = (*OVER_OPS, "neg", "sqrt", "rsqrt", "exp", "sigmoid", "silu")
# ops whose torch code always makes a new tensor (an output computed by one never aliases an executable buffer)
_NEW_TENSOR = {*FRESH_OPS, "pow", "lt", "le", "gt", "ge", "eq", "ne", "abs", "where", "matmul", "layer_norm"}
_FLOATS = ("float32", "float64")


@dataclass(frozen=True)
class GatherInto:
    """An all-gather whose result is a state tensor's new value, whole on this rank: it writes straight into the
    state tensor (no copy at the end of the step); `deferrable` when nothing after it reads the result (it may be
    left in flight when the step returns), `shm` when it runs on shared memory (at stage `stage`)."""

    gather: Value
    state: Value
    deferrable: bool
    stage: int
    shm: bool


@dataclass(frozen=True)
class OwnPart:
    """A fused stage's live-out computed straight into this rank's part of the state tensor a shared-memory
    all-gather fills (`state.narrow(dim, start, length)`): the gather then copies nothing of this rank's."""

    value: Value
    state: Value
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class FusedStage:
    """A fused computation (a function of its inputs) on this rank: what it reads from outside, its live-outs, the
    (state input, new value) pairs it writes over the state (nothing later reads the old contents) and its
    live-outs computed into their own part of a gathered state tensor (by value id)."""

    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    state_writes: tuple[tuple[Value, Value], ...]
    own_parts: dict[int, OwnPart]


@dataclass(frozen=True)
class Memory:
    """Where rank `view.rank`'s values live for one step of `plan` (see the module docstring)."""

    over: dict[int, int]  # value id -> index of the operand it is computed over (a temporary nothing reads after)
    into: dict[int, GatherInto]  # all_gather value id -> the state tensor it fills, in the plan's state order
    fused: dict[int, FusedStage]  # id of a fused Compute stage (or part) -> its inputs, outputs and state writes
    output_buffers: tuple[str, ...]  # value names whose executable buffer (keyed by the name) an output may be
    output_views: tuple[str, ...]  # those an output may share storage with without being the buffer itself

    @classmethod
    def of(cls, plan: Plan, view: RankView) -> Memory:
        """The decisions for `view`'s rank."""
        into = _gathers_into_state(plan, view)
        over: dict[int, int] = {}
        fused: dict[int, FusedStage] = {}
        live = plan.live_outs()
        for index, stage in enumerate(plan.stages):
            if _piecewise(stage):
                continue  # chunk by chunk, piece by piece: nothing is computed over a whole temporary
            for part in stage.parts if isinstance(stage, FusedCollective) else (stage,):
                if not isinstance(part, Compute):
                    continue
                over |= _over(view, part, live)
                if part.fused:
                    fused[id(part)] = _fused(plan, view, index, part, into)
        return cls(over, into, fused, *_output_buffers(plan, view))

    def state_writes(self, stage: Stage) -> tuple[tuple[Value, Value], ...]:
        """(state input, its new value) pairs fused stage `stage` writes over the state (none for other stages)."""
        f = self.fused.get(id(stage))
        return f.state_writes if f is not None else ()


def _read(a: Value) -> Value:
    """What reading `a` reads: an updated state reads as its new value."""
    return a.args[1] if a.op == "update" else a


def _over(view: RankView, stage: Compute, live: set[int]) -> dict[int, int]:
    """Values of computation stage `stage` written over a temporary of it that nothing reads after them
    (`a.add_(b)`): saves a full-size allocation per operation on CPU, where each one costs page faults. Only
    float32/64 arithmetic of equal shapes, on fresh results of arithmetic that are not live out."""
    live = live | {id(v) for v in stage.live_outs}
    fresh = {id(v) for v in stage.values if v.op in FRESH_OPS and v.dtype in _FLOATS and id(v) not in live
             and view.in_group(v)}
    last: dict[int, int] = {}
    for v in stage.values:
        for a in v.args:
            if id(a) in fresh:
                last[id(a)] = id(v)
    out: dict[int, int] = {}
    for v in stage.values:
        if v.op not in OVER_OPS or v.dtype not in _FLOATS:
            continue
        if any(a.dtype != v.dtype for a in v.args if not a.is_scalar):
            continue
        for j, a in enumerate(v.args[:2] if v.op in ("add", "mul") else v.args[:1]):
            if last.get(id(a)) == id(v) and view.local_shape(a) == view.local_shape(v):
                out[id(v)] = j
                break
    return out


def _gathers_into_state(plan: Plan, view: RankView) -> dict[int, GatherInto]:
    """All-gathers whose result is a state tensor's new value, whole on this rank, written straight into the state
    tensor when nothing after them reads the old contents (not chunked, not a fused ring: those gather into their
    own buffers)."""
    out: dict[int, GatherInto] = {}
    order = [x for s in plan.stages for x in s.values]
    for name, v in plan.state.items():
        t = plan.program.inputs[name]
        if v.op != "all_gather" or not view.in_group(v) or view.local_shape(t) != view.local_shape(v):
            continue
        at = next(i for i, s in enumerate(plan.stages) if any(x is v for x in s.values))
        stage = plan.stages[at]
        if _piecewise(stage):
            continue
        after = [a for x in order[order.index(v) + 1:] for a in x.args]
        if any(a is t for a in after):
            continue
        read_later = any(_read(a) is v for a in after) or any(_read(o) is v for _, o in plan.outputs)
        out[id(v)] = GatherInto(v, t, not read_later, at, getattr(stage, "algorithm", "library") == "shm")
    return out


def _fused(plan: Plan, view: RankView, index: int, stage: Compute, into: dict[int, GatherInto]) -> FusedStage:
    """The facts of fused stage `stage` (at top-level index `index`) on this rank."""
    vals = [v for v in stage.values if view.in_group(v)]
    inside = {id(v) for v in vals}
    params: dict[int, Value] = {}
    for v in vals:
        for a in map(_read, v.args):
            if id(a) not in inside and a.op != "const":
                params.setdefault(id(a), a)
    inputs = tuple(params.values())
    outs = tuple(v for v in vals if any(v is o for o in stage.live_outs))
    later = {id(a) for s in plan.stages[index + 1:] for v in s.values for a in v.args}
    later |= {id(v) for _, v in plan.outputs}
    writes = []
    for name, new in plan.state.items():
        t = plan.program.inputs[name]
        if any(v is new for v in outs) and any(p is t for p in inputs) and id(t) not in later and \
                view.in_group(t) and view.local_shape(t) == view.local_shape(new):
            writes.append((t, new))
    return FusedStage(inputs, outs, tuple(writes), _own_parts(plan, view, index, outs, inputs, into))


def _own_parts(plan: Plan, view: RankView, index: int, outs: tuple[Value, ...], inputs: tuple[Value, ...],
               into: dict[int, GatherInto]) -> dict[int, OwnPart]:
    """Live-outs of fused stage `index` that a shared-memory all-gather gathers straight into a state tensor the
    stage reads: computed into this rank's part of it, they save the gather a copy. Only where nothing between the
    stage and the gather reads the state."""
    out: dict[int, OwnPart] = {}
    for v in outs:
        for g in (g for g in into.values() if g.shm):
            ag, t = g.gather, g.state
            if ag.args[0] is not v or ag.layout.is_sliced or not any(p is t for p in inputs):
                continue
            between = [x for st in plan.stages[index + 1:g.stage + 1] for x in st.values if x is not ag]
            if any(a is t for x in between for a in x.args):
                continue
            d, shares = ag.attrs["dim"], getattr(v.layout, "shares", None)
            if shares or not v.layout.is_sliced or v.layout.dim != d or v.dtype != t.dtype:
                continue
            start, stop = view.bounds(v)[d]
            whole = view.local_shape(t)
            if tuple(view.local_shape(v)) != tuple(whole[:d]) + (stop - start,) + tuple(whole[d + 1:]):
                continue
            out[id(v)] = OwnPart(v, t, d, start, stop - start)
    return out


def _output_buffers(plan: Plan, view: RankView) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the communication values whose buffer an output of this rank may be, and of those it may share
    storage with without being the buffer object (a view of it, a shared-memory slot, a fused ring's piece):
    followed from each output through every operation that may return its operand's storage; a result of
    arithmetic is a new tensor, never a buffer. Executable.release looks only at these."""
    comm: dict[int, bool] = {}  # value of a communication stage -> whether its result may be a view or a slot
    for s in plan.stages:
        if not isinstance(s, Compute):
            for v in s.values:
                comm[id(v)] = getattr(s, "algorithm", "library") == "shm" or isinstance(s, FusedCollective)
    names: dict[str, None] = {}
    views: dict[str, None] = {}
    seen: set[tuple[int, bool]] = set()
    todo = [(_read(v), False) for _, v in plan.outputs if view.in_group(_read(v))]
    while todo:
        v, through_view = todo.pop()
        if (id(v), through_view) in seen or v.is_scalar or v.op in ("input", "const"):
            continue
        seen.add((id(v), through_view))
        if id(v) in comm:
            names[v.name] = None
            if through_view or comm[id(v)]:
                views[v.name] = None
        if v.op not in _NEW_TENSOR and not R.opdef(v.op).communication:  # a collective's result is its own buffer
            todo += [(_read(a), True) for a in v.args]
    return tuple(names), tuple(views)


def _piecewise(stage: Stage) -> bool:
    """Whether `stage` computes chunk by chunk or piece by piece (an overlap, or a fused collective on an algorithm
    that applies the computation as its pieces arrive): then nothing is computed over a whole temporary."""
    return isinstance(stage, Overlap) or (isinstance(stage, FusedCollective)
                                          and collectives.get(stage.algorithm).fuses)
