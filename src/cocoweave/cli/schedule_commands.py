"""`cocoweave schedules` and `cocoweave check`: list every legal schedule; prove them equivalent."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from ..equivalence.check import CheckRow, check_schedules, torch_runner, world_applicable
from ..equivalence.compare import TOLERANCES
from ..errors import LoadError
from ..ir.graph import Program
from ..ir.types import DTYPES
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from .common import EXIT_MISMATCH, console, fail, table, user_errors
from .options import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORLD,
    Device,
    JsonOpt,
    SizeOpt,
    SpecArg,
    TimeoutOpt,
    WallTimeoutOpt,
    WorldOpt,
    check_fits,
    check_local_worlds,
    check_output,
    load,
    parse_timeouts,
    parse_world_sizes,
    select,
    write_json,
)

BACKENDS = ("reference", "torch")

NOTATION = """\
Reading schedule names: the stages in the order they run, joined by '-'.
  c              computation as eager torch ops, one at a time
  C              computation fused into one generated kernel
  MM             a matmul
  AR, RS, AG     all_reduce, reduce_scatter, all_gather (A2A: all_to_all, BC: broadcast, R: reduce); repeats once
  P2P            send/recv between process groups (pipeline stages)
  fuse(RS-C-AG)  the stages inside run as one stage (here one fused collective)
  ol(MM,AR,C,4)  the stages inside run in 4 chunks: a chunk's communication overlaps the next's computation
  @ring          the collective or fused stage before it runs on a ring of point-to-point messages
  +slice(m,v)    state m and v are stored sliced: 1/p of each on every rank
Examples: AR-c is Adam as written; RS-C-AG+slice(m,v) splits its all_reduce, updates each slice in one
kernel and keeps m, v sliced; fuse(RS-C-AG)@ring is CoCoNet's fused ring."""


@user_errors
def schedules(spec: SpecArg, size: SizeOpt = None, as_json: JsonOpt = None) -> None:
    """List every legal schedule of a program (CoCoNet's recipe) with its steps."""
    check_output(as_json, "--json")
    program, _, _ = load(spec, size)
    found = enumerate_schedules(program)
    doc = [{"name": s.name, "fingerprint": s.fingerprint(), "steps": s.steps_json()} for s in found]
    if as_json != "-":
        t = table(f"{len(found)} schedules of {program.name}", {"#": "right", "schedule": "left", "steps": "left",
                                                                "stages": "right"})
        for i, s in enumerate(found):
            t.add_row(str(i), s.name, "\n".join(map(str, s.steps)) or "(as written)",
                      str(len(s.stages)))
        console.print(t)
    write_json(doc, as_json)


schedules.__doc__ = f"{schedules.__doc__}\n\n{NOTATION}"


def tolerances(program: Program) -> dict[str, tuple[float, float]]:
    """(atol, rtol) by dtype of the program's outputs and updated state: what `check` compares against."""
    names = sorted({v.dtype for _, v in program.outputs} | {v.dtype for v in program.updates.values()})
    return {n: TOLERANCES.get(DTYPES[n], (0.0, 0.0)) for n in names}


@user_errors
def check(
    spec: SpecArg,
    size: SizeOpt = None,
    world_size: WorldOpt = DEFAULT_WORLD,
    backend: Annotated[str, typer.Option(help="Backend to check: reference (simulated ranks) or torch (spawned "
                                              "ranks over torch.distributed).")] = "reference",
    device: Annotated[Device, typer.Option(help="torch backend: cpu or cuda.")] = "cpu",
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    wall_timeout: WallTimeoutOpt = None,
    schedule: Annotated[str | None, typer.Option(help="Check only this schedule.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    as_json: JsonOpt = None,
) -> None:
    """Run every schedule on random inputs against the unscheduled program; exit 1 on any mismatch.
    Each element must satisfy |actual - expected| <= atol + rtol x |expected| (the tolerances of its dtype,
    printed with the results)."""
    if backend not in BACKENDS:
        raise LoadError(f"backend {backend!r} is not available; use one of: {', '.join(BACKENDS)}")
    timeouts = parse_timeouts(timeout, wall_timeout)
    worlds = parse_world_sizes(world_size)
    check_output(as_json, "--json")
    program, given, bound = load(spec, size)
    chosen = select(program, schedule, device)
    from ..launch import in_torchrun

    if backend == "torch" and in_torchrun():
        _check_under_torchrun(program, chosen, None if world_size == DEFAULT_WORLD else world_size, bound, given,
                              seed, device, timeouts, as_json)
        return
    runnable = [w for w in worlds if world_applicable(program, w) is None]
    if not runnable:
        raise LoadError(world_applicable(program, worlds[0]))
    if backend == "torch":
        check_local_worlds(runnable)
    check_fits(program, bound, runnable, given)
    rows, skipped = [], {w: world_applicable(program, w) for w in worlds if w not in runnable}
    for w in runnable:
        if backend == "torch":
            rows += _check_torch(program, chosen, w, bound, seed, device, timeouts)
        else:
            rows += check_schedules(program, chosen, w, bound, seed)
    _report_check(program, chosen, runnable, backend, rows, skipped, as_json)


def _report_check(program: Program, chosen: list[Schedule], runnable: list[int], backend: str, rows: list[CheckRow],
                  skipped: dict[int, Any], as_json: str | None) -> None:
    """Print the table (unless --json -), write the JSON, and exit 1 when a check differs."""
    bad = [r for r in rows if not r.ok]
    tol = tolerances(program)
    if as_json != "-":
        _print_check(program, chosen, runnable, backend, rows, skipped, tol)
    write_json({"program": program.name, "backend": backend, "rows": [r.as_dict() for r in rows],
                "skipped": skipped, "ok": not bad,
                "tolerance": {n: {"atol": a, "rtol": r} for n, (a, r) in tol.items()}}, as_json)
    if bad:
        raise fail(f"{len(bad)} of {len(rows)} checks differ from the unscheduled program", EXIT_MISMATCH)


def _check_under_torchrun(program: Program, chosen: list[Schedule], world_size: str | None, sizes: dict[str, int],
                          given: dict[str, int], seed: int, device: str, timeouts: tuple[float, float | None],
                          as_json: str | None) -> None:
    """This process is one rank of a torchrun world: every rank runs every schedule on its part of the same random
    inputs, rank 0 gathers the results, compares them with the unscheduled program and reports (exit 1 on a
    mismatch); a failing rank is one sentence naming it (exit 4)."""
    from ..backends.inputs import make_inputs
    from ..backends.torch.worker import run_schedules
    from .torchrun_rank import gather_on_rank0, torchrun_rank

    with torchrun_rank(timeouts, device, world_size) as me:
        if (why := world_applicable(program, me.size)) is not None:
            raise LoadError(why)
        check_fits(program, sizes, [me.size], given)
        inputs = make_inputs(program, me.size, sizes, seed=seed)  # the same on every rank: one seed
        per_rank = gather_on_rank0(me, lambda: run_schedules(me.rank, me.size, chosen, inputs, sizes,
                                                               str(me.device)))
    if per_rank is None:
        return
    results = [[r[i] for r in per_rank] for i in range(len(chosen))]
    rows = check_schedules(program, chosen, me.size, sizes, seed, batch=lambda *_: results)
    _report_check(program, chosen, [me.size], "torch", rows, {}, as_json)


def _print_check(program: Program, chosen: list[Schedule], runnable: list[int], backend: str, rows: list[CheckRow],
                 skipped: dict[int, Any], tol: dict[str, tuple[float, float]]) -> None:
    within = ", ".join(f"{atol:.0e} + {rtol:.0e}|x|" + (f" ({name})" if len(tol) > 1 else "")
                       for name, (atol, rtol) in tol.items())
    t = table(f"{program.name}: {len(chosen)} schedules x world sizes {runnable} ({backend})",
              {"schedule": "left", "world": "right", "max abs err": "right", "max rel err": "right",
               "tolerance": "left", "pass": "left"})
    for r in rows:
        verdict = Text("yes", style="green") if r.ok else Text.assemble(("NO", "red"), f" {r.error or ''}")
        t.add_row(r.schedule, str(r.world_size), f"{r.max_abs:.1e}", f"{r.max_rel:.1e}", within, verdict)
    console.print(t)
    console.print("tolerance: every element must satisfy |actual - expected| <= atol + rtol x |expected|; "
                  + "; ".join(f"{name}: atol {atol:.0e}, rtol {rtol:.0e}" for name, (atol, rtol) in tol.items()),
                  highlight=False, markup=False)
    for w, why in skipped.items():
        console.print(f"world size {w} skipped: {why}", style="yellow", highlight=False, markup=False)


def _check_torch(program: Program, schedules: list[Schedule], world_size: int, sizes: dict[str, int], seed: int,
                 device: str, timeouts: tuple[float, float | None]) -> list[CheckRow]:
    """Every schedule on `world_size` spawned ranks (one LocalWorld, one call)."""
    from ..launch import LocalWorld

    timeout, wall = timeouts
    with LocalWorld(world_size, backend="auto", device=device, timeout_s=timeout, wall_timeout_s=wall) as world:
        return check_schedules(program, schedules, world_size, sizes, seed, batch=torch_runner(world, device))
