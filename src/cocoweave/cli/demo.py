"""`cocoweave demo`: the main job. On a local world of ranks it takes the paper's three workloads, enumerates
and checks their schedules, times them against plain torch baselines, prints a table per workload and writes
runs/demo-<UTC time>/ (report.md, results.json, bars.png, trace.json)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import torch
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..errors import LoadError
from ..launch import LocalWorld
from .common import EXIT_MISMATCH, console, fail, user_errors

if TYPE_CHECKING:
    from ..demo.runner import DemoResult

DEFAULT_WORKLOADS = "adam,model_parallel,pipeline_parallel"


@user_errors
def demo(
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Ranks of the local world.")] = 4,
    iters: Annotated[int, typer.Option(min=1, help="Timed steps per schedule (median reported).")] = 10,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed steps before them.")] = 3,
    out: Annotated[Path, typer.Option(help="Where runs/demo-<time>/ goes.")] = Path("runs"),
    quick: Annotated[bool, typer.Option(help="Tiny sizes (a smoke test of the whole pipeline).")] = False,
    device: Annotated[str, typer.Option(help="auto (cuda when present), cpu or cuda.")] = "auto",
    workloads: Annotated[str, typer.Option(help="Comma-separated workloads to run.")] = DEFAULT_WORKLOADS,
) -> None:
    """Check and time every schedule of the paper's workloads on a local world; write a report."""
    from ..demo.runner import WORKLOADS

    keys = [k.strip() for k in workloads.split(",") if k.strip()]
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown or not keys:
        raise LoadError(f"unknown workload {unknown[0] if unknown else '(none given)'!r}; choose from "
                        f"{', '.join(WORKLOADS)}")
    if device not in ("auto", "cpu", "cuda"):
        raise LoadError(f"device must be auto, cpu or cuda, got {device!r}")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    t0 = time.perf_counter()
    with console.status(f"starting {world_size} ranks ({dev})"):
        world = LocalWorld(world_size, backend="auto", device=dev, timeout_s=300)
    with world:
        folder, result = demo_on(world, keys, quick=quick, iters=iters, warmup=warmup, out=out,
                                 start_s=time.perf_counter() - t0)
    bad = [(w.key, r.schedule) for w in result.workloads for r in w.rows if not r.checked]
    if bad:
        raise fail(f"{len(bad)} schedules differ from their program as written (first: {bad[0][1]} of "
                   f"{bad[0][0]}); see {folder / 'report.md'}", EXIT_MISMATCH)


def demo_on(world: LocalWorld, keys: list[str], *, quick: bool, iters: int, warmup: int, out: Path,
            start_s: float = 0.0, command: str | None = None) -> tuple[Path, DemoResult]:
    """The demo on a started world: a progress bar, a table per workload as it finishes, then the report
    folder (returned with the results)."""
    from ..demo.report import rich_table, write_report  # matplotlib loads only when asked for
    from ..demo.runner import run_demo

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("enumerating schedules", total=0)
        started = [False]

        def advance(what: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=what)

        def on_total(n: int) -> None:
            progress.update(task, total=(progress.tasks[0].total or 0) + n)

        result = run_demo(world, keys, quick=quick, iters=iters, warmup=warmup, advance=advance,
                          on_total=on_total, on_workload=lambda w: progress.console.print(rich_table(w)))
        progress.advance(task)
    result.start_s = start_s
    folder = write_report(result, out, command)
    ranks = f"{world.world_size} rank{'s' if world.world_size != 1 else ''}"
    console.print(f"{ranks} ({result.backend}, {result.device}): world started in {start_s:.1f} s, "
                  f"workloads took {result.total_s:.1f} s. Report: {folder / 'report.md'}", highlight=False)
    return folder, result
