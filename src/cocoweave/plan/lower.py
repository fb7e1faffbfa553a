"""Lowering a Schedule to a Plan: resolve the stages' value names, compute each stage's live-outs once,
flatten chunked chains into parts that each run on their own, collect host scalars and state."""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Program, Value
from ..schedule.schedule import Schedule
from ..schedule.stages import Compute, FusedCollective, Overlap, Stage, value
from .plan import Plan


def _resolve(program: Program, s: Stage) -> Stage:
    """The stage with Values for names (its parts too)."""
    vals = tuple(value(program, n) for n in s.values)
    if isinstance(s, FusedCollective | Overlap):
        return replace(s, values=vals, parts=tuple(_resolve(program, p) for p in s.parts))
    return replace(s, values=vals)


def _flatten(parts: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """A fused collective inside a chunked chain runs as its parts (RS, C, AGs), so that each collective can be
    in flight while another chunk computes."""
    out: list[Stage] = []
    for s in parts:
        if isinstance(s, FusedCollective):
            out += [p if not isinstance(p, Compute) else replace(p, fused=True) for p in s.parts]
        else:
            out.append(s)
    return tuple(out)


def _read(a: Value) -> Value:
    """What reading `a` reads: an updated state reads as its new value."""
    return a.args[1] if a.op == "update" else a


def _with_live_outs(s: Stage, needed: set[int]) -> Stage:
    """s with `live_outs`: its values that `needed` holds; each of its parts likewise, counting also what the
    other parts read."""
    parts = getattr(s, "parts", ())
    if parts:
        marked = []
        for p in parts:
            keep = needed | {id(_read(a)) for q in parts if q is not p for v in q.values for a in v.args}
            marked.append(replace(p, live_outs=tuple(v for v in p.values if id(v) in keep)))
        s = replace(s, parts=tuple(marked))
    return replace(s, live_outs=tuple(v for v in s.values if id(v) in needed))


def lower(schedule: Schedule | Program) -> Plan:
    """The Plan every rank runs for `schedule` (a bare Program is lowered as written)."""
    if isinstance(schedule, Program):
        schedule = Schedule(schedule)
    p = schedule.program
    host: list[Value] = [v for v in p.values if v.is_scalar and v.op not in ("scalar", "const")]
    state = {name: upd.args[1] for name, upd in p.updates.items()}
    stages = [_resolve(p, s) for s in schedule.stages]
    stages = [replace(s, parts=_flatten(s.parts)) if isinstance(s, Overlap) else s for s in stages]
    needed = {id(_read(v)) for _, v in p.outputs} | {id(v) for v in state.values()}
    for s in stages:  # read across a top-level stage boundary
        needed |= {id(a) for a in s.reads()}
    stages = [_with_live_outs(s, needed) for s in stages]
    return Plan(name=schedule.name, program=p, stages=stages, host=host, state=state,
                sliced_state=schedule.sliced_state, outputs=list(p.outputs), fingerprint=schedule.fingerprint(),
                unsliced={n: schedule.original.inputs[n].layout for n in schedule.sliced_state})
