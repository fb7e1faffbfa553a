"""Checking schedules: run each on random inputs and compare with the program as written.

Equivalence is the law of cocoweave: every schedule the tool can produce must compute the same
outputs and state as the unscheduled program, within the tolerance of their dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..backends import reference
from ..backends.inputs import make_inputs
from ..errors import CocoweaveError, ProgramError
from ..ir.graph import Program
from ..schedule.schedule import Schedule
from .compare import compare_results

Runner = Callable[[Schedule, list, Mapping[str, int]], list]
BatchRunner = Callable[[Sequence[Schedule], list, Mapping[str, int]], list[list]]  # results per schedule


@dataclass
class CheckRow:
    """The result of one schedule at one world size."""

    schedule: str
    world_size: int
    max_abs: float
    max_rel: float
    ok: bool
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def world_applicable(program: Program, world_size: int) -> str | None:
    """None if the program can run on `world_size` ranks (its stages, mesh and shares fit), else why not."""
    try:
        program.check_world(world_size)
    except ProgramError as e:
        return str(e)
    return None


def reference_runner(schedule: Schedule, inputs: list, sizes: Mapping[str, int]) -> list:
    return reference.run(schedule, inputs, sizes, whole_state=True)


def torch_runner(world: Any, device: str = "cpu", kernels: str | None = None) -> BatchRunner:
    """Runs every schedule on the live ranks of `world` (a cocoweave.launch.LocalWorld) in one call, fused stages
    on route `kernels` (the executables' default when None); a failing rank raises BackendError (the ranks'
    collectives cannot go on after one rank fails)."""

    def run(schedules: Sequence[Schedule], inputs: list, sizes: Mapping[str, int]) -> list[list]:
        from ..backends.torch.worker import run_schedules

        per_rank = world.run(run_schedules, list(schedules), inputs, dict(sizes), device, kernels)
        return [[r[i] for r in per_rank] for i in range(len(schedules))]

    return run


def check_schedules(program: Program, schedules: Sequence[Schedule], world_size: int,
                    sizes: Mapping[str, int] | None = None, seed: int = 0,
                    runner: Runner = reference_runner, batch: BatchRunner | None = None,
                    scalars: Mapping[str, float] | None = None) -> list[CheckRow]:
    """Compare every schedule with the unscheduled program (reference backend) on one set of random
    inputs at `world_size` ranks. A schedule that fails to run gives a row with the error. `batch`
    (e.g. torch_runner) runs all schedules at once instead of `runner` one by one."""
    sizes = dict(sizes or {})
    inputs = make_inputs(program, world_size, sizes, seed=seed, scalars=scalars)  # scalars: else random
    expected = reference.run(program, inputs, sizes, whole_state=True)
    if batch is not None:
        results = batch(schedules, inputs, sizes)
        return [_row(program, s, world_size, res, expected) for s, res in zip(schedules, results)]
    rows = []
    for s in schedules:
        try:
            rows.append(_row(program, s, world_size, runner(s, inputs, sizes), expected))
        except CocoweaveError as e:
            rows.append(CheckRow(s.name, world_size, float("nan"), float("nan"), False, str(e)))
    return rows


def _row(program: Program, s: Schedule, world_size: int, got: list, expected: list) -> CheckRow:
    d = compare_results(program, got, expected)
    return CheckRow(s.name, world_size, d.max_abs, d.max_rel, d.ok)
