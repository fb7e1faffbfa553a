"""`cocoweave measure` (sweep world sizes and schedules into the store) and `cocoweave tune` (predict,
measure the best k and the baseline, cache the fastest)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..equivalence.check import world_applicable
from ..errors import CocoweaveError, LoadError
from ..schedule.schedule import Schedule
from .common import console, err_console, fail, table, user_errors
from .options import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORLD,
    DeviceOpt,
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

BACKEND = "torch"
ItersOpt = Annotated[int, typer.Option(min=1, help="Timed iterations per schedule.")]
WarmupOpt = Annotated[int, typer.Option(min=0, help="Untimed iterations first.")]
StoreOpt = Annotated[Path | None, typer.Option(
    "--store", help="Measurement store folder (default: $COCOWEAVE_STORE or .cocoweave/store).")]
RoundsOpt = Annotated[int, typer.Option(
    min=1, help="Rounds in which the schedules take turns (iterations are split between rounds).")]


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


def _open(world_size: int, device: str, timeouts: tuple[float, float | None]) -> Any:
    """A LocalWorld for measuring, with the per-wait and wall timeouts of the command line."""
    from ..perf.measure import open_world

    return open_world(world_size, device, *timeouts)


@user_errors
def measure(
    spec: SpecArg,
    size: SizeOpt = None,
    world_size: WorldOpt = DEFAULT_WORLD,
    schedule: Annotated[list[str] | None, typer.Option(
        help="Measure only this schedule (repeatable; default: every schedule).")] = None,
    device: DeviceOpt = "cpu",
    iters: ItersOpt = 10,
    warmup: WarmupOpt = 3,
    rounds: RoundsOpt = 2,
    store: StoreOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    wall_timeout: WallTimeoutOpt = None,
    as_json: JsonOpt = None,
) -> None:
    """Measure schedules of a program on local worlds of each size and record every timing in the store
    (each world's timings as soon as that world is done)."""
    from ..perf.measure import record
    from ..perf.model import CostModel

    timeouts = parse_timeouts(timeout, wall_timeout)
    worlds = parse_world_sizes(world_size)
    check_output(as_json, "--json")
    program, given, sym = load(spec, size)
    chosen = [s for name in schedule for s in select(program, name, device)] if schedule \
        else select(program, None, device)
    for w in worlds:
        _check_world(program, w)
    check_local_worlds(worlds)
    check_fits(program, sym, worlds, given)
    st = _store(store)
    rows: list[dict[str, Any]] = []
    with _progress() as progress:
        for w in worlds:
            model = CostModel.load(BACKEND, device, w, st)
            preds = {s.name: model.predict(s, sym, w) for s in chosen} if model is not None else {}
            with _open(w, device, timeouts) as world:
                ms = _measurer(world, sym, device, iters, warmup, rounds, timeouts[0], progress, f"{w} ranks")(chosen)
            record(st, program, sym, ms, backend=BACKEND, device=device, source="measure",
                   predictions={n: p.analytic for n, p in preds.items()})
            base = next((m.total_ms for m in ms if not m.schedule.steps), None)
            rows += [{"world_size": w, "schedule": m.name, "measured_ms": m.total_ms,
                      "predicted_ms": None if m.name not in preds else preds[m.name].ms,
                      "speedup_vs_as_written": None if base is None else base / m.total_ms} for m in ms]
    if as_json != "-":
        t = table(f"{program.name}: measured step time (ms, median of {iters}; slowest rank), {device}",
                  {"world": "right", "schedule": "left", "measured": "right", "predicted": "right",
                   "vs as written": "right"})
        for r in rows:
            t.add_row(str(r["world_size"]), r["schedule"], f"{r['measured_ms']:.3f}",
                      "—" if r["predicted_ms"] is None else f"{r['predicted_ms']:.3f}",
                      "—" if r["speedup_vs_as_written"] is None else f"{r['speedup_vs_as_written']:.2f}x")
        console.print(t)
        console.print(f"{len(rows)} measurements appended to {st.path}", style="dim", highlight=False, markup=False)
    write_json({"program": program.name, "device": device, "store": str(st.path), "rows": rows}, as_json)


@user_errors
def tune(
    spec: SpecArg,
    size: SizeOpt = None,
    world_size: WorldOpt = DEFAULT_WORLD,
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
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    wall_timeout: WallTimeoutOpt = None,
    as_json: JsonOpt = None,
) -> None:
    """Predict every schedule, measure the k best and the program as written, cache the fastest measured
    (for each world size in turn). Measurements go to the store before the choice goes to the cache."""
    from ..tune import TuneCache

    timeouts = parse_timeouts(timeout, wall_timeout)
    worlds = parse_world_sizes(world_size)
    check_output(as_json, "--json")
    program, given, sym = load(spec, size)
    for w in worlds:
        _check_world(program, w)
    check_local_worlds(worlds)
    check_fits(program, sym, worlds, given)
    tune_cache = TuneCache(cache)
    tune_cache.entries()  # an unreadable cache fails now, not after the measurements
    st = _store(store)
    docs = [_tune_one(program, sym, w, k, device, iters, warmup, rounds, check_all, st, tune_cache, timeouts,
                      as_json != "-") for w in worlds]
    write_json(docs[0] if len(docs) == 1 else docs, as_json)


def _tune_one(program, sym: dict[str, int], world_size: int, k: int, device: str, iters: int, warmup: int,
              rounds: int, check_all: bool, st: Any, tune_cache: Any, timeouts: tuple[float, float | None],
              show: bool) -> dict[str, Any]:
    """Tune one world size: measure, record in the store, then cache the choice; returns its JSON document."""
    from ..perf.measure import record
    from ..perf.model import CostModel
    from ..tune import tune as run_tuner
    from ..tune.tuner import cache_entry

    model = CostModel.load(BACKEND, device, world_size, st)
    preds: dict[str, Any] = {}

    def predict(s: Schedule) -> float:
        preds[s.name] = model.predict(s, sym, world_size)
        return preds[s.name].ms

    with _progress() as progress, _open(world_size, device, timeouts) as world:
        measure_fn = _measurer(world, sym, device, iters, warmup, rounds, timeouts[0], progress, "measuring")
        result = run_tuner(program, sym, world_size, measure=measure_fn, predict=predict if model else None, k=k,
                           backend=BACKEND, device=device, cache=None)
        checked = measure_fn([c.schedule for c in result.candidates]) if check_all else []
    analytic = {n: p.analytic for n, p in preds.items()}
    record(st, program, sym, [c.measured for c in result.measured()], backend=BACKEND, device=device,
           source="tune", predictions=analytic)
    record(st, program, sym, checked, backend=BACKEND, device=device, source="tune --check-all",
           predictions=analytic)
    checked_ms = {m.name: m.total_ms for m in checked}
    if show:
        _print_tune(result, model, world_size, device, iters, checked_ms)
    try:
        tune_cache.put(result.key, cache_entry(result))
    except CocoweaveError as exc:
        raise fail(f"{str(exc).rstrip('.')}; the measurements are in the store {st.path}, so tuning again once the "
                   "cache can be written finds them") from None
    if show:
        console.print(f"cached under {result.key} in {tune_cache.path}", style="dim", highlight=False, markup=False)
    return {"program": program.name, "world_size": world_size, "device": device, "key": result.key,
            "choice": result.choice.name, "baseline": result.baseline.name, "speedup": result.speedup,
            "cache": str(tune_cache.path), "store": str(st.path), "notes": list(result.notes),
            "candidates": [{"schedule": c.name, "predicted_ms": c.predicted_ms, "measured_ms": c.measured_ms,
                            "check_all_ms": checked_ms.get(c.name)} for c in result.candidates]}


def _print_tune(result, model, world_size: int, device: str, iters: int, checked: dict[str, float]) -> None:
    corrected = model is not None and model.correction is not None
    cols = ["", "schedule", "predicted" + (" (corr.)" if corrected else ""), "measured", "vs as written"]
    t = table(f"{result.program.name} on {world_size} ranks ({device}): predicted vs measured ms (median of "
              f"{iters}, slowest rank)", {col: "left" if col in ("", "schedule") else "right"
                                          for col in cols + (["check: all"] if checked else [])})
    base = result.baseline.measured_ms
    for c in result.candidates:
        mark = "★" if c is result.choice else ("base" if c is result.baseline else "")
        row = [mark, c.name, "—" if c.predicted_ms is None else f"{c.predicted_ms:.3f}",
               "—" if c.measured_ms is None else f"{c.measured_ms:.3f}",
               "—" if c.measured_ms is None else f"{base / c.measured_ms:.2f}x"]
        t.add_row(*row, *([f"{checked[c.name]:.3f}"] if checked else []),
                  style="bold green" if c is result.choice else None)
    console.print(t)
    for note in result.notes:
        console.print(note, style="yellow", highlight=False, markup=False)
    ch = result.choice
    console.print(Text.assemble(("chose", "bold"), f" {ch.name}: {ch.measured_ms:.3f} ms vs {base:.3f} ms as "
                                f"written ({result.speedup:.2f}x)"), highlight=False)
    if checked:
        best = min(checked, key=checked.get)
        gap = 100 * (checked[ch.name] / checked[best] - 1)
        vs_base = checked[result.baseline.name] / checked[ch.name]
        console.print(f"check (every schedule measured again, taking turns): best {best} {checked[best]:.3f} ms; "
                      f"the choice {checked[ch.name]:.3f} ms is {gap:.1f}% slower than the best "
                      + ("(within 5%)" if gap <= 5 else "(NOT within 5%)")
                      + f" and {vs_base:.2f}x the as-written speed", highlight=False, markup=False)
