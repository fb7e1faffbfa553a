"""`cocoweave measure` (sweep world sizes and schedules into the store) and `cocoweave tune` (predict,
measure the best k and the baseline, cache the fastest)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..check import world_applicable
from ..errors import LoadError
from ..loader import load_program, parse_sizes, symbolic_sizes
from ..schedule.schedule import Schedule
from .common import console, err_console, user_errors
from .options import SizeOpt, SpecArg, parse_world_sizes, select

BACKEND = "torch"
DeviceOpt = Annotated[str, typer.Option(help="Device of the ranks: cpu (Gloo) or cuda.")]
ItersOpt = Annotated[int, typer.Option(min=1, help="Timed iterations per schedule.")]
WarmupOpt = Annotated[int, typer.Option(min=0, help="Untimed iterations first.")]
StoreOpt = Annotated[Path | None, typer.Option(
    "--store", help="Measurement store folder (default: $COCOWEAVE_STORE or .cocoweave/store).")]
RoundsOpt = Annotated[int, typer.Option(
    min=1, help="Rounds in which the schedules take turns (iterations are split between rounds).")]
TimeoutOpt = Annotated[float, typer.Option(min=1, help="Seconds one schedule's measurement may take.")]


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


def _measurer(world: Any, sizes: dict[str, int], device: str, iters: int, warmup: int, rounds: int, timeout: float,
              progress: Progress, label: str) -> Callable[[Sequence[Schedule]], list]:
    from ..perf.measure import measure_schedules

    def measure(schedules: Sequence[Schedule]) -> list:
        task = progress.add_task(label, total=len(schedules) * max(1, min(rounds, iters)))

        def step(s: Schedule) -> None:
            progress.update(task, description=f"{label}: {s.name}")
            progress.advance(task)

        out = measure_schedules(world, schedules, sizes, device=device, iters=iters, warmup=warmup, rounds=rounds,
                                timeout_s=timeout, progress=step)
        progress.remove_task(task)
        return out

    return measure


def _store(path: Path | None):
    from ..perf.store import MeasurementStore

    return MeasurementStore(path)


def _check_world(program, world_size: int) -> None:
    why = world_applicable(program, world_size)
    if why is not None:
        raise LoadError(f"{program.name} cannot run on {world_size} ranks: {why}")


@user_errors
def measure(
    spec: SpecArg,
    size: SizeOpt = None,
    world_size: Annotated[str, typer.Option("--world-size", "-n", help="Ranks: 4, 1-8 or 1,2,4.")] = "1,2,4",
    schedule: Annotated[list[str] | None, typer.Option(
        help="Measure only this schedule (repeatable; default: every schedule).")] = None,
    device: DeviceOpt = "cpu",
    iters: ItersOpt = 10,
    warmup: WarmupOpt = 3,
    rounds: RoundsOpt = 2,
    store: StoreOpt = None,
    timeout: TimeoutOpt = 300.0,
) -> None:
    """Measure schedules of a program on local worlds of each size and record every timing in the store."""
    from ..perf.measure import open_world, record
    from ..perf.model import CostModel

    sizes = parse_sizes(size)
    program = load_program(spec, sizes)
    sym = symbolic_sizes(program, sizes)
    chosen = [s for name in schedule for s in select(program, name)] if schedule else select(program, None)
    worlds = parse_world_sizes(world_size)
    for w in worlds:
        _check_world(program, w)
    st = _store(store)
    table = Table(title=f"{program.name}: measured step time (ms, median of {iters}; slowest rank), {device}")
    for col in ("world", "schedule", "measured", "predicted", "vs as written"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    count = 0
    with _progress() as progress:
        for w in worlds:
            model = CostModel.load(BACKEND, device, w, st)
            preds = {s.name: model.predict(s, sym, w) for s in chosen} if model is not None else {}
            with open_world(w, device, timeout) as world:
                ms = _measurer(world, sym, device, iters, warmup, rounds, timeout, progress, f"{w} ranks")(chosen)
            record(st, program, sym, ms, backend=BACKEND, device=device, source="measure",
                   predictions={n: p.analytic for n, p in preds.items()})
            count += len(ms)
            base = next((m.total_ms for m in ms if not m.schedule.steps), None)
            for m in ms:
                p = preds.get(m.name)
                table.add_row(str(w), m.name, f"{m.total_ms:.3f}", "—" if p is None else f"{p.ms:.3f}",
                              "—" if base is None else f"{base / m.total_ms:.2f}x")
    console.print(table)
    console.print(f"{count} measurements appended to {st.path}", style="dim")


@user_errors
def tune(
    spec: SpecArg,
    size: SizeOpt = None,
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of ranks.")] = 4,
    k: Annotated[int, typer.Option("-k", min=1, help="Measure the k best predicted schedules.")] = 3,
    device: DeviceOpt = "cpu",
    iters: ItersOpt = 10,
    warmup: WarmupOpt = 3,
    rounds: RoundsOpt = 2,
    check_all: Annotated[bool, typer.Option(
        "--check-all", help="Also measure every other schedule, to show how far the choice is from the best.")]
    = False,
    store: StoreOpt = None,
    cache: Annotated[Path | None, typer.Option(
        help="Tuning cache file (default: $COCOWEAVE_TUNE_CACHE or .cocoweave/tune-cache.json).")] = None,
    timeout: TimeoutOpt = 300.0,
) -> None:
    """Predict every schedule, measure the k best and the program as written, cache the fastest measured."""
    from ..perf.measure import open_world, record
    from ..perf.model import CostModel
    from ..tune import TuneCache
    from ..tune import tune as run_tuner

    sizes = parse_sizes(size)
    program = load_program(spec, sizes)
    sym = symbolic_sizes(program, sizes)
    _check_world(program, world_size)
    st = _store(store)
    model = CostModel.load(BACKEND, device, world_size, st)
    preds: dict[str, Any] = {}

    def predict(s: Schedule) -> float:
        preds[s.name] = model.predict(s, sym, world_size)
        return preds[s.name].ms

    with _progress() as progress, open_world(world_size, device, timeout) as world:
        measure_fn = _measurer(world, sym, device, iters, warmup, rounds, timeout, progress, "measuring")
        result = run_tuner(program, sym, world_size, measure=measure_fn, predict=predict if model else None, k=k,
                           backend=BACKEND, device=device, cache=TuneCache(cache))
        checked = measure_fn([c.schedule for c in result.candidates]) if check_all else []
    analytic = {n: p.analytic for n, p in preds.items()}
    record(st, program, sym, [c.measured for c in result.measured()], backend=BACKEND, device=device,
           source="tune", predictions=analytic)
    record(st, program, sym, checked, backend=BACKEND, device=device, source="tune --check-all",
           predictions=analytic)
    _print_tune(result, model, world_size, device, iters, {m.name: m.total_ms for m in checked})


def _print_tune(result, model, world_size: int, device: str, iters: int, checked: dict[str, float]) -> None:
    corrected = model is not None and model.correction is not None
    table = Table(title=f"{result.program.name} on {world_size} ranks ({device}): predicted vs measured ms "
                        f"(median of {iters}, slowest rank)", title_justify="left")
    cols = ["", "schedule", "predicted" + (" (corr.)" if corrected else ""), "measured", "vs as written"]
    for col in cols + (["check: all"] if checked else []):
        table.add_column(col, justify="left" if col in ("", "schedule") else "right")
    base = result.baseline.measured_ms
    for c in result.candidates:
        mark = "★" if c is result.choice else ("base" if c is result.baseline else "")
        row = [mark, c.name, "—" if c.predicted_ms is None else f"{c.predicted_ms:.3f}",
               "—" if c.measured_ms is None else f"{c.measured_ms:.3f}",
               "—" if c.measured_ms is None else f"{base / c.measured_ms:.2f}x"]
        table.add_row(*row, *([f"{checked[c.name]:.3f}"] if checked else []),
                      style="bold green" if c is result.choice else None)
    console.print(table)
    for note in result.notes:
        console.print(note, style="yellow")
    ch = result.choice
    console.print(f"[bold]chose[/] {ch.name}: {ch.measured_ms:.3f} ms vs {base:.3f} ms as written "
                  f"({result.speedup:.2f}x); cached under {result.key}", highlight=False)
    if checked:
        best = min(checked, key=checked.get)
        gap = 100 * (checked[ch.name] / checked[best] - 1)
        vs_base = checked[result.baseline.name] / checked[ch.name]
        console.print(f"check (every schedule measured again, taking turns): best {best} {checked[best]:.3f} ms; "
                      f"the choice {checked[ch.name]:.3f} ms is {gap:.1f}% slower than the best "
                      + ("(within 5%)" if gap <= 5 else "(NOT within 5%)")
                      + f" and {vs_base:.2f}x the as-written speed", highlight=False)
