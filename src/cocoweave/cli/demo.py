"""`cocoweave demo`: the main job. On a local world of ranks it takes the paper's three workloads, enumerates
and checks their schedules, times them against plain torch baselines (a fresh dropout mask every step), prints a
table per workload, what was proven and timed, and writes runs/demo-<UTC time>/ (report.md, results.json,
bars.png, trace.json)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import torch
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..errors import LoadError
from ..launch import LocalWorld
from .common import EXIT_MISMATCH, console, fail, user_errors
from .options import (
    DEFAULT_WORLD,
    JsonOpt,
    TimeoutOpt,
    WallTimeoutOpt,
    WorldOpt,
    check_local_worlds,
    check_output,
    parse_timeouts,
    parse_world_sizes,
    write_json,
)

if TYPE_CHECKING:
    from ..demo.runner import DemoResult

DEFAULT_WORKLOADS = "adam,model_parallel,pipeline_parallel"


@user_errors
def demo(
    world_size: WorldOpt = DEFAULT_WORLD,
    iters: Annotated[int, typer.Option(min=1, help="Timed steps per schedule (median reported).")] = 10,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed steps before them.")] = 3,
    out: Annotated[Path, typer.Option(help="Where runs/demo-<time>/ goes.")] = Path("runs"),
    quick: Annotated[bool, typer.Option(help="Tiny sizes (a smoke test of the whole pipeline).")] = False,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option(
        help="auto (cuda when present), cpu or cuda.")] = "auto",
    workloads: Annotated[str, typer.Option(help="Comma-separated workloads to run.")] = DEFAULT_WORKLOADS,
    timeout: TimeoutOpt = 300.0,
    wall_timeout: WallTimeoutOpt = None,
    as_json: JsonOpt = None,
) -> None:
    """Check and time every schedule of the paper's workloads on a local world (of each size in turn); write a
    report folder per world."""
    from ..demo.runner import WORKLOADS

    keys = [k.strip() for k in workloads.split(",") if k.strip()]
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown or not keys:
        raise LoadError(f"unknown workload {unknown[0] if unknown else '(none given)'!r}; choose from "
                        f"{', '.join(WORKLOADS)}")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    timeout_s, wall_s = parse_timeouts(timeout, wall_timeout)
    worlds = parse_world_sizes(world_size)
    check_local_worlds(worlds)
    check_output(as_json, "--json")
    console.quiet = as_json == "-"  # the JSON is the output
    try:
        docs, bad = _demo_worlds(worlds, keys, dev, timeout_s, wall_s, quick, iters, warmup, out)
    finally:
        console.quiet = False
    write_json(docs[0] if len(docs) == 1 else docs, as_json)
    if bad:
        size, folder, first = bad
        raise fail(f"{first[2]} schedules differ from their program as written on {size} ranks (first: "
                   f"{first[1]} of {first[0]}); see {folder / 'report.md'}", EXIT_MISMATCH)


def _demo_worlds(worlds: list[int], keys: list[str], dev: str, timeout_s: float, wall_s: float | None, quick: bool,
                 iters: int, warmup: int, out: Path) -> tuple[list[dict], tuple | None]:
    """The demo on a world of each size in turn, until one finds a schedule that differs from its program:
    each world's results.json (with its folder), and (size, folder, (workload, schedule, count)) of a failure."""
    docs = []
    for size in worlds:
        t0 = time.perf_counter()
        with console.status(f"starting {size} ranks ({dev})"):
            world = LocalWorld(size, backend="auto", device=dev, timeout_s=timeout_s, wall_timeout_s=wall_s)
        with world:
            folder, result = demo_on(world, keys, quick=quick, iters=iters, warmup=warmup, out=out,
                                     start_s=time.perf_counter() - t0)
        docs.append(json.loads((folder / "results.json").read_text()) | {"folder": str(folder)})
        bad = [(w.key, r.schedule) for w in result.workloads for r in w.rows if not r.checked]
        if bad:
            return docs, (size, folder, (*bad[0], len(bad)))
    return docs, None

def demo_on(world: LocalWorld, keys: list[str], *, quick: bool, iters: int, warmup: int, out: Path,
            start_s: float = 0.0, command: str | None = None) -> tuple[Path, DemoResult]:
    """The demo on a started world: a progress bar, a table per workload as it finishes, then the report
    folder (returned with the results)."""
    from ..demo.report import headline, rich_table, summary, write_report  # matplotlib loads only when asked for
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
    for line in summary(result) + [headline(w) for w in result.workloads]:
        console.print(line, highlight=False, markup=False)
    ranks = f"{world.world_size} rank{'s' if world.world_size != 1 else ''}"
    console.print(f"{ranks} ({result.backend}, {result.device}): world started in {start_s:.1f} s, "
                  f"workloads took {result.total_s:.1f} s. Report: {folder / 'report.md'}", highlight=False)
    return folder, result
