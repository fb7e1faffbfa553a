"""Lowering a Schedule to a Plan: map schedule stages to plan stages, collect host scalars and state."""

from __future__ import annotations

from ..ir.graph import Program, Value
from ..schedule.schedule import Schedule
from ..schedule.stages import Stage, value
from .plan import P2P, Chunked, Collective, FusedCollective, Kernel, MatMul, Plan, PlanStage


def _plan_stage(program: Program, s: Stage) -> PlanStage:
    vals = [value(program, n) for n in s.values]
    if s.kind == "compute":
        return Kernel(vals, fused=s.fused)
    if s.kind == "matmul":
        return MatMul(vals)
    if s.kind == "collective":
        return Collective(vals, algorithm=s.algorithm)
    if s.kind == "p2p":
        return P2P(vals)
    if s.kind == "fused":
        parts = [_plan_stage(program, p) for p in s.parts]
        kernels = [p for p in parts if isinstance(p, Kernel)]
        return FusedCollective(vals, reduce_scatter=parts[0].values[0], kernel=kernels[0] if kernels else None,
                               all_gathers=[p.values[0] for p in parts if isinstance(p, Collective)][1:],
                               algorithm=s.algorithm)
    if s.kind == "overlap":
        return Chunked(vals, stages=[_plan_stage(program, p) for p in s.parts], chunks=s.chunks, dim=s.chunk_dim)
    raise ValueError(f"unknown stage kind {s.kind!r}")


def lower(schedule: Schedule | Program) -> Plan:
    """The Plan every rank runs for `schedule` (a bare Program is lowered as written)."""
    if isinstance(schedule, Program):
        schedule = Schedule(schedule)
    p = schedule.program
    host: list[Value] = [v for v in p.values if v.is_scalar and v.op not in ("scalar", "const")]
    state = {name: upd.args[1] for name, upd in p.updates.items()}
    return Plan(name=schedule.name, program=p, stages=[_plan_stage(p, s) for s in schedule.stages], host=host,
                state=state, sliced_state=schedule.sliced_state, outputs=list(p.outputs),
                fingerprint=schedule.fingerprint())
