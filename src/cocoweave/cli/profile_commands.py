"""`cocoweave profile SCRIPT.py`: run a training script written for torchrun on local worlds of several
sizes, fit how its step scales, name the bottleneck, predict other sizes (checked where they can run here)
and model catalog GPUs."""

from __future__ import annotations

import hashlib
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import CocoweaveError
from .common import err_console, user_errors
from .json_output import JsonOpt, check_writable, human, write_json
from .options import check_output, parse_world_sizes

VALIDATE_UP_TO_CORES = 4  # predicted sizes up to 4 x cores are also measured (to check the prediction)


def _store_rows(profile, runs) -> list[dict]:
    """One measurement-store row per measured world (program 'script:NAME', schedule 'as written')."""
    from ..perf.store import provenance

    text = Path(profile.script).read_bytes() + "\0".join(profile.script_args).encode()
    fp = hashlib.sha256(text).hexdigest()[:16]
    prov = provenance()
    return [{"program": f"script:{profile.name}", "program_fingerprint": fp, "schedule": "as written",
             "schedule_fingerprint": fp, "sizes": {}, "world_size": r.world_size, "backend": "torchrun",
             "device": "cpu", "stage_times_ms": {k.removesuffix("_ms"): v for k, v in r.phases_ms.items()},
             "total_ms": r.step_ms, "iters": len(r.steps_ms),
             "extra": {"source": "profile", "times_ms": r.steps_ms, "cpu_ms": r.cpu_ms,
                       "collectives": r.collectives, "script_args": profile.script_args,
                       "threads_per_rank": r.threads, "load_avg": r.load_avg, "io": r.io}, **prov} for r in runs]


def _measured_table(profile) -> Table:
    model = profile.model
    table = Table(title=f"{profile.name} measured on this host ({model.cores} cores, "
                        f"{profile.host['threads_per_rank']} thread per rank): ms per step", title_justify="left")
    for col in ("ranks", "role", "step", "input", "compute (CPU)", "comm (CPU)", "waiting", "core sharing",
                "others' CPU"):
        table.add_column(col, justify="left" if col == "role" else "right")
    from ..cluster.profiling.host_scaling import measured_parts

    for r in sorted(profile.runs, key=lambda r: r.world_size):
        parts = measured_parts(r, model)
        role = "fit" if r.world_size in profile.fit_world_sizes else "check"
        table.add_row(str(r.world_size), role, f"{r.step_ms:.1f}", f"{parts.input_ms:.1f}", f"{parts.compute_ms:.1f}",
                      f"{parts.comm_cpu_ms:.1f}", f"{parts.wait_ms:.1f}", f"{parts.contention_ms:.1f}",
                      "—" if r.other_load is None else f"{100 * r.other_load:.0f}%")
    return table


def _prediction_table(predictions) -> Table:
    table = Table(title="predicted step on this host (ms)", title_justify="left")
    for col in ("ranks", "predicted", "input", "compute", "communication", "core sharing", "measured", "error"):
        table.add_column(col, justify="right")
    for p in predictions:
        s = p.parts
        table.add_row(str(p.world_size), f"{p.predicted_ms:.1f}", f"{s.input_ms:.1f}", f"{s.compute_ms:.1f}",
                      f"{s.comm_ms:.1f}",
                      f"{s.contention_ms:.1f}", "—" if p.measured_ms is None else f"{p.measured_ms:.1f}",
                      "—" if p.error_pct is None else f"{p.error_pct:+.1f}%")
    return table


def _modelled_table(steps) -> Table:
    table = Table(title="MODELLED step on catalog machines (roofline + alpha-beta; not measured), ms",
                  title_justify="left")
    for col in ("machine", "GPU", "GPUs", "step", "compute", "communication", "link"):
        table.add_column(col, justify="left" if col in ("machine", "GPU", "link") else "right")
    for s in steps:
        table.add_row(s["machine"], s["gpu"], str(s["world_size"]), f"{s['total_ms']:.3f}", f"{s['compute_ms']:.3f}",
                      f"{s['comm_ms']:.3f}", s["link"] or "—")
    return table


@contextmanager
def _progress_bar(name: str, worlds: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr over the `worlds` world runs; yields profile_worlds' `progress` callback
    (called as each world starts, so that the one before has finished)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task(f"profiling {name}", total=worlds)
        started = 0

        def progress(p: int) -> None:
            nonlocal started
            bar.update(task, completed=started, description=f"profiling {name}: {p} rank{'s' * (p > 1)}")
            started += 1

        yield progress
        bar.update(task, completed=worlds)


@user_errors
def profile(
    script: Annotated[Path, typer.Argument(help="A training script written for torchrun (SCRIPT.py).")],
    script_args: Annotated[list[str] | None, typer.Argument(
        help="Arguments for the script, after --: cocoweave profile train.py -n 1,2,3 -- --batch 24 (default: its "
             "'# cocoweave profile: ARGS' line, if it has one).")] = None,
    world_sizes: Annotated[str, typer.Option(
        "--world-sizes", "-n", help="Local world sizes to measure and fit the model on: 4, 1-8 or 1,2,4.")] = "1,2,3",
    predict: Annotated[str | None, typer.Option(
        help="World sizes to predict (4, 1-8 or 1,2,4); those this host can run (up to 4 x its cores) are "
             "measured too, to check the prediction, unless --no-check.")] = None,
    check: Annotated[bool, typer.Option(help="Measure predicted sizes this host can run.")] = True,
    steps: Annotated[int, typer.Option(min=1, help="Timed steps per world.")] = 20,
    warmup: Annotated[int, typer.Option(min=2, help="Untimed steps first (one of them is counted).")] = 3,
    threads: Annotated[int, typer.Option(min=1, help="Intra-op threads per rank (OMP_NUM_THREADS).")] = 1,
    rounds: Annotated[int, typer.Option(
        min=1, help="Rounds in which the sizes take turns (--steps each per round): a slow spell of the machine "
                    "then falls on every size (one round moved a 4-rank prediction by up to 18% on a quiet VM).")]
    = 3,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds one world may take.")] = 300.0,
    train_steps: Annotated[int, typer.Option(
        min=1, help="Training steps `cocoweave plan` assumes for this run unless given --steps.")] = 100_000,
    json_path: JsonOpt = None,
    store: Annotated[Path | None, typer.Option(
        "--store", help="Measurement store folder (default: $COCOWEAVE_STORE or .cocoweave/store).")] = None,
    png: Annotated[Path | None, typer.Option(
        "--png", help="Write the measured-vs-predicted scaling plot (ms per step against ranks) to this PNG "
                      "file.")] = None,
) -> None:
    """Profile a training script on local worlds, fit its scaling, name the bottleneck, predict other sizes."""
    from ..cluster.catalog import load_catalog
    from ..cluster.profiling.io_summary import transfer_sentence
    from ..cluster.profiling.plot import write_profile_png
    from ..cluster.profiling.run_profile import RunProfile, host_info
    from ..cluster.profiling.worlds import cores, default_script_args, profile_worlds
    from ..perf.store import MeasurementStore

    check_writable(json_path)
    check_output(png, "--png")
    out = human(json_path)
    fit_sizes = sorted(set(parse_world_sizes(world_sizes)))
    predict_sizes = sorted(set(parse_world_sizes(predict))) if predict else []
    n_cores = cores()
    extra = [p for p in predict_sizes if check and p not in fit_sizes and p <= VALIDATE_UP_TO_CORES * n_cores]
    if len(fit_sizes) < 2 or max(fit_sizes) < 2:
        raise CocoweaveError(f"--world-sizes {world_sizes} must name at least two sizes, one of 2 or more ranks.")
    if not script_args and (script_args := default_script_args(script)):
        err_console.print(f"[dim]script arguments from its '# cocoweave profile:' line: {shlex.join(script_args)}[/]",
                          highlight=False)
    start = time.perf_counter()
    with _progress_bar(script.name, rounds * len(set(fit_sizes + extra))) as progress:
        runs = profile_worlds(script, script_args or [], fit_sizes + extra, steps=steps, warmup=warmup,
                              threads=threads, timeout_s=timeout, rounds=rounds, progress=progress)
    command = shlex.join(["cocoweave", "profile", *sys.argv[2:]])
    prof = RunProfile(str(script), list(script_args or []), fit_sizes, runs, host_info(n_cores, threads),
                      train_steps, command)
    if sharing := prof.measure_core_sharing(predict_sizes, VALIDATE_UP_TO_CORES * n_cores):
        err_console.print("[dim]core sharing measured beyond the cores (synchronised processes of the predicted CPU "
                          "time per step): " + ", ".join(f"x{f:.2f} at {p} ranks" for p, f in sharing.items()) + "[/]",
                          highlight=False)
    MeasurementStore(store).append(_store_rows(prof, runs))
    predictions = prof.predict(predict_sizes)
    catalog = load_catalog()
    doc = prof.to_json(predict_sizes, catalog)
    out.print(_measured_table(prof))
    if (warning := prof.busy_warning()) is not None:  # a warning is no table: shown with --json - too
        (err_console if json_path == "-" else out).print(f"[yellow]warning:[/] {warning}", highlight=False)
    m = prof.model
    out.print(f"[dim]model: compute {m.a_ms:.2f} + {m.b_ms:.2f} x work share ms; communication CPU "
              f"{m.gamma_ms_per_mb:.2f} ms/MB + {m.delta_ms_per_hop:.3f} ms/hop; CPU time "
              f"x{m.busy_cores(m.cores):.2f} with every core busy; waiting {m.omega_ms_per_hop:.3f} ms/hop; "
              f"core sharing beyond {m.cores} ranks x{m.eta_bal:.2f} spread evenly, x(1 + {m.mu:.2f} x imbalance) "
              f"unevenly, CPU time x{m.shared_cpu:.2f} sharing a core"
              f"{''.join(f', x{m.eta_bal:.2f} x {f:.2f} synthetic at {p}' for p, f in m.sharing.items())}; input "
              f"{m.input_ms:.2f} + "
              f"{m.input_ms_per_rank:.2f} x (ranks - 1) ms waited, {m.input_cpu_ms:.2f} ms CPU[/]", highlight=False)
    if (ckpt := prof.checkpoint_measured()) is not None:
        out.print(f"checkpoint: {ckpt[2]} took {1e3 * ckpt[0]:.1f} ms for {ckpt[1] / 1e6:.2f} MB "
                  f"({ckpt[1] / 1e6 / ckpt[0]:.0f} MB/s; the slowest rank's mean)", highlight=False)
    if (copies := transfer_sentence(min(prof.runs, key=lambda r: r.world_size).io)) is not None:
        out.print(copies, highlight=False)
    out.print(f"[bold]Bottleneck:[/] {doc['bottleneck']}", highlight=False)
    if predictions:
        out.print(_prediction_table(predictions))
        mape = doc["validation_mape_pct"]
        if mape is not None:
            checked = ", ".join(str(p.world_size) for p in predictions if p.measured_ms is not None)
            out.print(f"[bold]Prediction error[/] (fit on {', '.join(map(str, fit_sizes))} ranks, checked on "
                      f"{checked}): MAPE {mape:.1f}%", highlight=False)
        if doc["modelled"]["steps"]:
            out.print(_modelled_table(doc["modelled"]["steps"]))
        else:
            out.print(f"[dim]no MODELLED steps: {doc['modelled']['note']}[/]", highlight=False)
    if png is not None:
        try:
            path = write_profile_png(prof, predict_sizes, png, f"{prof.name}: measured and predicted step")
        except OSError as exc:
            raise CocoweaveError(f"cannot write the plot {png}: {exc.strerror or exc}.") from None
        out.print(f"plot written to {path}", highlight=False)
    out.print(f"[dim]{len(runs)} worlds measured in {time.perf_counter() - start:.1f} s; {len(runs)} rows appended "
              f"to the measurement store[/]", highlight=False)
    write_json(json_path, doc)
