"""CLI of the cost model: `cocoweave perf calibrate|predict|accuracy`; the perf group also holds
`perf cmdare` (cluster planning, cli/cluster_commands.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.table import Table

from cocoweave.errors import CocoweaveError

from .cluster_commands import cmdare_command
from .common import console, fail

T = TypeVar("T")

perf_app = typer.Typer(help="Performance models: calibrate, predict, accuracy; the CM-DARE reproduction.",
                       no_args_is_help=True, add_completion=False)


@perf_app.callback()
def perf_main() -> None:
    """Performance models: calibrate, predict, accuracy; the CM-DARE reproduction."""


perf_app.command("cmdare")(cmdare_command)


def _run_or_exit(fn: Callable[[], T]) -> T:
    """Run `fn`; a user error prints one sentence and exits with code 2 instead of a traceback."""
    try:
        return fn()
    except CocoweaveError as exc:
        raise fail(str(exc)) from None


@perf_app.command("calibrate")
def calibrate_command(
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Ranks of the local world.")] = 4,
    device: Annotated[str, typer.Option(help="Device of the ranks: cpu (Gloo) or cuda.")] = "cpu",
    iters: Annotated[int, typer.Option(min=2, help="Timed iterations per microbenchmark.")] = 7,
    store: Annotated[Path | None, typer.Option("--store", help="Measurement store folder.")] = None,
) -> None:
    """Run the cost model's microbenchmarks on a local world, fit alpha-beta and roofline terms, save them."""
    from cocoweave.perf.calibrate import Spec, combine, fit, microbench
    from cocoweave.perf.costmodel import calibration_path, save_calibration
    from cocoweave.perf.measure import open_world
    from cocoweave.perf.store import MeasurementStore, provenance

    kind = device.split(":")[0]
    start = time.perf_counter()

    def measure():
        with open_world(world_size, kind, timeout_s=300) as world:
            per_rank = world.call(microbench, (Spec(iters=iters, device=kind),), timeout_s=300)
            return combine(per_rank), world.backend

    with console.status(f"microbenchmarks on {world_size} ranks ({kind})..."):
        rows, wire = _run_or_exit(measure)
    cal = fit(rows, "torch", kind, world_size, meta={"wire": wire, **{k: str(v) for k, v in provenance().items()}})
    path = _run_or_exit(lambda: save_calibration(cal, calibration_path("torch", kind, world_size)))
    st = MeasurementStore(store)
    prov = provenance()
    _run_or_exit(lambda: st.append([
        {"program": f"microbenchmark:{r['kind']}", "program_fingerprint": f"microbenchmark:{r['key']}",
         "schedule": r["key"], "schedule_fingerprint": r["key"], "sizes": {"elements": int(r["elements"])},
         "world_size": world_size, "backend": "torch", "device": kind, "stage_times_ms": {}, "total_ms": r["ms"],
         "iters": len(r["times_ms"]), "extra": {"source": "calibrate", "amount": r["amount"],
                                                 "times_ms": r["times_ms"], "wire": wire}, **prov}
        for r in rows]))
    table = Table(title=f"calibration: torch/{kind}, {world_size} ranks ({wire}); t = alpha + beta x size",
                  title_justify="left")
    for col in ("term", "alpha ms", "beta", "rate", "fit %"):
        table.add_column(col, justify="left" if col == "term" else "right", no_wrap=True)
    lines = ([("comm", k, v) for k, v in cal.collectives.items()] + [("kernel", k, v) for k, v in cal.kernels.items()]
             + [("matmul", k, v) for k, v in cal.matmuls.items()])
    for kind_, key, line in lines:
        pts = [r for r in rows if r["kind"] == kind_ and r["key"] == key]
        err = 100 * sum(abs(line(r["amount"]) - r["ms"]) / r["ms"] for r in pts) / len(pts)
        unit = ("GFLOP/s", "ms/Mflop") if kind_ == "matmul" else ("GB/s", "ms/MB")
        rate = "—" if line.beta_ms_per_mb <= 0 else f"{1 / line.beta_ms_per_mb:.2f} {unit[0]}"
        table.add_row(key if kind_ == "comm" else f"{kind_} {key}", f"{line.alpha_ms:.4f}",
                      f"{line.beta_ms_per_mb:.4f} {unit[1]}", rate, f"{err:.0f}")
    console.print(table)
    console.print(f"calibration written to {path}; {len(rows)} timings appended to {st.path} "
                  f"({time.perf_counter() - start:.1f} s)", highlight=False)


@perf_app.command("predict")
def predict_command(
    spec: Annotated[str, typer.Argument(help="A program: FILE.py:FUNCTION.")],
    size: Annotated[list[str] | None, typer.Option("--size", "-s", help="A size as NAME=INT (repeatable).")] = None,
    world_size: Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of ranks.")] = 4,
    device: Annotated[str, typer.Option(help="Device: cpu or cuda.")] = "cpu",
    correct: Annotated[bool, typer.Option(help="Apply the learned correction trained on the store.")] = True,
    store: Annotated[Path | None, typer.Option("--store", help="Measurement store folder.")] = None,
) -> None:
    """Predict the step time of every schedule of a program from the calibrated cost model."""
    from cocoweave.loader import load_program, parse_sizes, symbolic_sizes
    from cocoweave.perf.model import CostModel
    from cocoweave.perf.store import MeasurementStore
    from cocoweave.schedule.enumerate import enumerate_schedules

    def build():
        sizes = parse_sizes(size)
        program = load_program(spec, sizes)
        sym = symbolic_sizes(program, sizes)
        model = CostModel.load("torch", device, world_size, MeasurementStore(store), correct=correct)
        if model is None:
            raise CocoweaveError(f"no calibration for torch/{device} on {world_size} ranks; run "
                                 f"`cocoweave perf calibrate --world-size {world_size} --device {device}` first.")
        preds = sorted((model.predict(s, sym, world_size) for s in enumerate_schedules(program)), key=lambda p: p.ms)
        return program, model, preds

    program, model, preds = _run_or_exit(build)
    corr = model.correction
    table = Table(title=f"{program.name} on {world_size} ranks ({device}): predicted step time, fastest first",
                  title_justify="left")
    for col in ("schedule", "analytic ms", "corrected ms", "largest stages (analytic ms)"):
        table.add_column(col, justify="left" if col in ("schedule", "largest stages (analytic ms)") else "right")
    for p in preds:
        top = sorted(p.analytic.stage_ms.items(), key=lambda kv: -kv[1])[:3]
        table.add_row(p.schedule.name, f"{p.analytic.total_ms:.3f}", "—" if corr is None else f"{p.ms:.3f}",
                      ", ".join(f"{k} {v:.2f}" for k, v in top))
    console.print(table)
    console.print("learned correction: " + ("none (too few measured rows in the store, or --no-correct)"
                                            if corr is None else f"{corr.kind} on {corr.n_rows} store rows"),
                  style="dim")


@perf_app.command("accuracy")
def accuracy_command(
    png: Annotated[Path, typer.Option("--png", help="Where to write the scatter plot.")] = Path("accuracy.png"),
    test_fraction: Annotated[float, typer.Option(min=0.05, max=0.9, help="Share of configurations held out.")]
    = 0.25,
    seed: Annotated[int, typer.Option(help="Seed of the split.")] = 0,
    device: Annotated[str | None, typer.Option(help="Only rows of this device (default: all).")] = None,
    store: Annotated[Path | None, typer.Option("--store", help="Measurement store folder.")] = None,
) -> None:
    """MAPE of the cost model, analytic and corrected, on held-out store measurements, and a scatter plot."""
    from cocoweave.perf.correction import accuracy, training_rows
    from cocoweave.perf.store import MeasurementStore

    def build():
        rows = training_rows(MeasurementStore(store).load(), "torch", device)
        return accuracy(rows, test_fraction, seed)

    report = _run_or_exit(build)
    table = Table(title=f"cost model accuracy on {report.n_test} held-out measurements "
                        f"(trained on {report.n_train})", title_justify="left")
    for col in ("model", "MAPE %"):
        table.add_column(col, justify="left" if col == "model" else "right")
    table.add_row("analytic (calibrated alpha-beta + roofline)", f"{report.analytic_mape:.1f}")
    table.add_row(f"analytic x learned correction ({report.kind})", f"{report.corrected_mape:.1f}")
    console.print(table)
    path = _run_or_exit(lambda: _write_scatter(report, png))
    console.print(f"plot written to {path}")


def _write_scatter(report, path: Path) -> Path:
    from cocoweave.perf.correction import scatter_png

    try:
        return scatter_png(report, path, "cost model: predicted vs measured (held out)")
    except OSError as exc:
        raise CocoweaveError(f"cannot write the plot {path}: {exc.strerror or exc}.") from exc
