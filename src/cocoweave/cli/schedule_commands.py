"""`cocoweave schedules` and `cocoweave check`: list every legal schedule; prove them equivalent."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from ..check import CheckRow, check_schedules, torch_runner, world_applicable
from ..errors import LoadError
from ..loader import load_program, parse_sizes, symbolic_sizes
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from .common import EXIT_MISMATCH, console, fail, user_errors
from .options import SizeOpt, SpecArg, parse_world_sizes, select

BACKENDS = ("reference", "torch")


@user_errors
def schedules(spec: SpecArg, size: SizeOpt = None,
              as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List every legal schedule of a program (CoCoNet's recipe) with its steps."""
    program = load_program(spec, parse_sizes(size))
    found = enumerate_schedules(program)
    if as_json:
        print(json.dumps([{"name": s.name, "fingerprint": s.fingerprint(), "steps": s.steps} for s in found],
                         indent=2))
        return
    table = Table(title=f"{len(found)} schedules of {program.name}")
    for col in ("#", "schedule", "steps", "stages"):
        table.add_column(col)
    for i, s in enumerate(found):
        from ..schedule.schedule import _format_step

        table.add_row(str(i), s.name, "\n".join(_format_step(x) for x in s.steps) or "(as written)",
                      str(len(s.stages)))
    console.print(table)


@user_errors
def check(
    spec: SpecArg,
    size: SizeOpt = None,
    world_size: Annotated[str, typer.Option("--world-size", "-n", help="Ranks: 4, 1-8 or 1,2,4.")] = "4",
    backend: Annotated[str, typer.Option(help="Backend to check: reference (simulated ranks) or torch (spawned "
                                              "ranks over torch.distributed).")] = "reference",
    device: Annotated[str, typer.Option(help="torch backend: cpu or cuda.")] = "cpu",
    timeout: Annotated[float, typer.Option(min=0.1, help="torch backend: seconds a rank may wait for the "
                                                         "others before the check fails.")] = 60.0,
    schedule: Annotated[str | None, typer.Option(help="Check only this schedule.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Run every schedule on random inputs against the unscheduled program; exit 1 on any mismatch."""
    if backend not in BACKENDS:
        raise LoadError(f"backend {backend!r} is not available; use one of: {', '.join(BACKENDS)}")
    sizes = parse_sizes(size)
    program = load_program(spec, sizes)
    chosen = select(program, schedule)
    worlds = parse_world_sizes(world_size)
    runnable = [w for w in worlds if world_applicable(program, w) is None]
    if not runnable:
        raise LoadError(world_applicable(program, worlds[0]))
    rows, skipped = [], {w: world_applicable(program, w) for w in worlds if w not in runnable}
    for w in runnable:
        if backend == "torch":
            rows += _check_torch(program, chosen, w, symbolic_sizes(program, sizes), seed, device, timeout)
        else:
            rows += check_schedules(program, chosen, w, symbolic_sizes(program, sizes), seed)
    bad = [r for r in rows if not r.ok]
    if as_json:
        print(json.dumps({"program": program.name, "backend": backend, "rows": [r.as_dict() for r in rows],
                          "skipped": skipped, "ok": not bad}, indent=2))
    else:
        table = Table(title=f"{program.name}: {len(chosen)} schedules x world sizes {runnable} ({backend})")
        for col in ("schedule", "world", "max abs err", "max rel err", "pass"):
            table.add_column(col, justify="right" if "err" in col or col == "world" else "left")
        for r in rows:
            table.add_row(r.schedule, str(r.world_size), f"{r.max_abs:.2e}", f"{r.max_rel:.2e}",
                          "[green]yes[/]" if r.ok else f"[red]NO[/] {r.error or ''}")
        console.print(table)
        for w, why in skipped.items():
            console.print(f"world size {w} skipped: {why}", style="yellow")
    if bad:
        raise fail(f"{len(bad)} of {len(rows)} checks differ from the unscheduled program", EXIT_MISMATCH)


def _check_torch(program, schedules: list[Schedule], world_size: int, sizes: dict[str, int], seed: int,
                 device: str, timeout: float) -> list[CheckRow]:
    """Every schedule on `world_size` spawned ranks (one LocalWorld, one call)."""
    from ..launch import LocalWorld

    if device not in ("cpu", "cuda"):
        raise LoadError(f"--device must be cpu or cuda, got {device!r}")
    with LocalWorld(world_size, backend="auto", device=device, timeout_s=timeout) as world:
        return check_schedules(program, schedules, world_size, sizes, seed, batch=torch_runner(world, device))
