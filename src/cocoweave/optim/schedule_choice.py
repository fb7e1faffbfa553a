"""Which schedule a bucket's program runs: by name, the tuner's cached choice, or the most-sliced legal one; and the
scalar all-reduce a clipped schedule pauses before."""

from __future__ import annotations

from .. import collectives
from ..errors import OptimizerError
from ..ir.graph import Program
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from ..tune import Context, choose

_SCHEDULES: dict[str, list[Schedule]] = {}


def _schedules(program: Program, device: str) -> list[Schedule]:
    """enumerate_schedules for tensors on `device`, memoised by program fingerprint (every bucket of one size shares
    them) and the table of collective algorithms' generation."""
    key = f"{program.fingerprint()}/{device}/{collectives.generation()}"
    if key not in _SCHEDULES:
        _SCHEDULES[key] = enumerate_schedules(program, device)
    return _SCHEDULES[key]


def norm_reduction(schedule: Schedule) -> str | None:
    """The name of the scalar all-reduce of a clipped program's squared-norm partials (split and reorder insert
    it), or None when the schedule has none (the gradient's all-reduce was not split)."""
    by_name = {v.name: v for v in schedule.program.values}
    for stage in schedule.stages:
        for name in stage.names:
            if by_name[name].op == "all_reduce" and by_name[name].ndim == 0:
                return name
    return None


def resolve_schedule(program: Program, schedule: str, world_size: int, whole: set[str], device: str = "cpu",
                     shared_host: bool = False, clipped: bool = False) -> Schedule:
    """The schedule to run: `schedule` by name, or for "auto" the tuner's cached choice (cocoweave.tune), else the
    schedule keeping the most optimizer state sliced on several ranks (through shared memory when the ranks share a
    CPU host), the fused program as written on one. Schedules that slice a tensor of `whole` (the parameters the
    model reads) are never used; a clipped program needs one whose norm partials are all-reduced."""
    legal = [s for s in _schedules(program, device) if not set(s.sliced_state) & whole
             and (not clipped or norm_reduction(s) is not None)]
    if schedule != "auto":
        for s in legal:
            if s.name == schedule:
                return s
        raise OptimizerError(f"schedule {schedule!r} is not available for program `{program.name}` here; "
                             f"choose one of: auto, {', '.join(s.name for s in legal)}")
    context = Context(world_size, device, tuned=world_size > 1, allowed={s.name for s in legal})
    return choose(program, context, lambda: most_sliced(legal, world_size, device, shared_host))


def most_sliced(legal: list[Schedule], world_size: int, device: str, shared_host: bool) -> Schedule:
    """The optimizers' "auto" without a tuned choice: on several ranks the schedule keeping the most state sliced
    with every computation one loop, on the collective algorithms the table prefers; the fused program as written
    on one."""
    if world_size == 1:
        return next((s for s in legal if s.name in ("AR-C", "C")), legal[0])
    most = max(len(s.sliced_state) for s in legal)
    best = [s for s in legal if len(s.sliced_state) == most and "fuse(" not in s.name
            and not any(st.kind == "compute" and not st.fused for st in s.stages)]  # every computation one loop
    return (collectives.choose(best, device, shared_host) or legal)[0]  # on the algorithms the table prefers
