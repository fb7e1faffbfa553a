"""CLI of the cost model: `cocoweave perf calibrate|predict|accuracy`; the perf group also holds
`perf cmdare` (cluster planning, cli/cluster_commands.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cocoweave.errors import CocoweaveError

from .cluster_commands import cmdare_command
from .common import err_console, user_errors
from .json_output import JsonOpt, check_writable, human, write_json
from .options import Device, DeviceOpt, load, parse_world_sizes

perf_app = typer.Typer(help="Performance models: calibrate, predict, accuracy; the CM-DARE reproduction.",
                       no_args_is_help=True, add_completion=False)


@perf_app.callback()
def perf_main() -> None:
    """Performance models: calibrate, predict, accuracy; the CM-DARE reproduction."""


perf_app.command("cmdare")(cmdare_command)


def _calibrate_one(world_size: int, kind: str, iters: int, st, out) -> dict:
    """Run the microbenchmarks on one local world, save the calibration, store the timings; print the fit."""
    from cocoweave.perf.calibrate import Spec, combine, fit, microbench
    from cocoweave.perf.costmodel import calibration_path, save_calibration
    from cocoweave.perf.measure import open_world
    from cocoweave.perf.store import provenance

    start = time.perf_counter()
    with err_console.status(f"microbenchmarks on {world_size} ranks ({kind})..."):
        with open_world(world_size, kind, timeout_s=300) as world:
            per_rank = world.call(microbench, (Spec(iters=iters, device=kind),), timeout_s=300)
            rows, wire = combine(per_rank), world.backend
    cal = fit(rows, "torch", kind, world_size, meta={"wire": wire, **{k: str(v) for k, v in provenance().items()}})
    path = save_calibration(cal, calibration_path("torch", kind, world_size))
    prov = provenance()
    st.append([
        {"program": f"microbenchmark:{r['kind']}", "program_fingerprint": f"microbenchmark:{r['key']}",
         "schedule": r["key"], "schedule_fingerprint": r["key"], "sizes": {"elements": int(r["elements"])},
         "world_size": world_size, "backend": "torch", "device": kind, "stage_times_ms": {}, "total_ms": r["ms"],
         "iters": len(r["times_ms"]), "extra": {"source": "calibrate", "amount": r["amount"],
                                                 "times_ms": r["times_ms"], "wire": wire}, **prov}
        for r in rows])
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
    out.print(table)
    out.print(f"calibration written to {path}; {len(rows)} timings appended to {st.path} "
              f"({time.perf_counter() - start:.1f} s)", highlight=False)
    return {"world_size": world_size, "path": str(path), "calibration": cal.to_json()}


@perf_app.command("calibrate")
@user_errors
def calibrate_command(
    world_size: Annotated[str, typer.Option(
        "--world-size", "-n", help="Ranks of the local world: 4, 1-8 or 1,2,4 (one calibration each).")] = "4",
    device: DeviceOpt = "cpu",
    iters: Annotated[int, typer.Option(min=2, help="Timed iterations per microbenchmark.")] = 7,
    store: Annotated[Path | None, typer.Option("--store", help="Measurement store folder.")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Run the cost model's microbenchmarks on local worlds, fit alpha-beta and roofline terms, save them."""
    from cocoweave.perf.store import MeasurementStore

    check_writable(json_path)
    out, st = human(json_path), MeasurementStore(store)
    kind = device.split(":")[0]
    docs = [_calibrate_one(w, kind, iters, st, out) for w in parse_world_sizes(world_size)]
    write_json(json_path, docs)


def _predict_table(program, world_size: int, device: str, preds, corrected: bool) -> Table:
    table = Table(title=f"{program.name} on {world_size} ranks ({device}): predicted step time, fastest first",
                  title_justify="left")
    for col in ("schedule", "analytic ms", "corrected ms", "largest stages (analytic ms)"):
        left = col in ("schedule", "largest stages (analytic ms)")
        table.add_column(col, justify="left" if left else "right")
    for p in preds:
        top = sorted(p.analytic.stage_ms.items(), key=lambda kv: -kv[1])[:3]
        table.add_row(p.schedule.name, f"{p.analytic.total_ms:.3f}", f"{p.ms:.3f}" if corrected else "—",
                      ", ".join(f"{k} {v:.2f}" for k, v in top))
    return table


@perf_app.command("predict")
@user_errors
def predict_command(
    spec: Annotated[str, typer.Argument(help="A program: FILE.py:FUNCTION.")],
    size: Annotated[list[str] | None, typer.Option("--size", "-s", help="A size as NAME=INT (repeatable).")] = None,
    world_size: Annotated[str, typer.Option(
        "--world-size", "-n", help="Ranks: 4, 1-8 or 1,2,4 (a table each).")] = "4",
    device: DeviceOpt = "cpu",
    correct: Annotated[bool, typer.Option(help="Apply the learned correction trained on the store.")] = True,
    store: Annotated[Path | None, typer.Option("--store", help="Measurement store folder.")] = None,
    json_path: JsonOpt = None,
) -> None:
    """Predict the step time of every schedule of a program from the calibrated cost model."""
    from cocoweave.perf.model import CostModel
    from cocoweave.perf.store import MeasurementStore
    from cocoweave.schedule.enumerate import enumerate_schedules

    check_writable(json_path)
    out = human(json_path)
    program, _, sym = load(spec, size)  # within the loading timeout, as every command that loads a program
    schedules = enumerate_schedules(program, device)
    docs, measurements, fitted = [], MeasurementStore(store), None
    for w in parse_world_sizes(world_size):
        model = CostModel.load("torch", device, w, measurements, correct=correct, fitted=fitted)
        if model is None:
            raise CocoweaveError(f"no calibration for torch/{device} on {w} ranks; run "
                                 f"`cocoweave perf calibrate --world-size {w} --device {device}` first.")
        fitted = (model.correction, model.correction_note) if correct else None  # trained once for every size
        preds = sorted((model.predict(s, sym, w) for s in schedules), key=lambda p: p.ms)
        corr = model.correction
        out.print(_predict_table(program, w, device, preds, corr is not None))
        out.print(f"learned correction: {model.correction_note}", style="dim", highlight=False)
        docs.append({"world_size": w, "device": device, "correction": model.correction_note,
                     "schedules": [{"schedule": p.schedule.name, "analytic_ms": p.analytic.total_ms,
                                    "predicted_ms": p.ms, "stage_ms": p.analytic.stage_ms} for p in preds]})
    write_json(json_path, {"program": program.name, "sizes": sym, "predictions": docs})


def _no_rows_reason(df, device: str | None, store_path: Path) -> str:
    """Why the store has nothing to judge the cost model on, and what to run."""
    count = len(df) if device is None else int((df["device"] == device).sum())
    which = "" if device is None else f" of device {device} ({len(df)} in all)"
    return (f"an accuracy report needs measurements with the cost model's prediction beside them: the store at "
            f"{store_path} has {count} measurements{which} and none of them has one; run `cocoweave perf calibrate` "
            "and then `cocoweave measure FILE.py:FUNCTION` (or `cocoweave tune`) first.")


@perf_app.command("accuracy")
@user_errors
def accuracy_command(
    png: Annotated[Path | None, typer.Option("--png", help="Write the predicted-vs-measured scatter plot here.")]
    = None,
    test_fraction: Annotated[float, typer.Option(min=0.05, max=0.9, help="Share of configurations held out.")]
    = 0.25,
    seed: Annotated[int, typer.Option(help="Seed of the split.")] = 0,
    device: Annotated[Device | None, typer.Option(help="Only rows of this device (default: all).")] = None,
    store: Annotated[Path | None, typer.Option("--store", help="Measurement store folder.")] = None,
    json_path: JsonOpt = None,
) -> None:
    """MAPE of the cost model, analytic and corrected, on held-out store measurements (and a scatter plot)."""
    from cocoweave.perf.correction import accuracy, training_rows
    from cocoweave.perf.store import MeasurementStore

    check_writable(json_path)
    out = human(json_path)
    st = MeasurementStore(store)
    df = st.load()
    rows = training_rows(df, "torch", device)
    if rows.empty:
        raise CocoweaveError(_no_rows_reason(df, device, st.path))
    report = accuracy(rows, test_fraction, seed)
    table = Table(title=f"cost model accuracy on {report.n_test} held-out measurements "
                        f"(trained on {report.n_train})", title_justify="left")
    for col in ("model", "MAPE %"):
        table.add_column(col, justify="left" if col == "model" else "right")
    table.add_row("analytic (calibrated alpha-beta + roofline)", f"{report.analytic_mape:.1f}")
    table.add_row(f"analytic x learned correction ({report.kind})", f"{report.corrected_mape:.1f}")
    out.print(table)
    better = report.corrected_mape < report.analytic_mape
    out.print(f"[dim]the learned correction is {'applied' if better else 'not applied'} by `perf predict` and the "
              f"tuner: it measured {'better' if better else 'no better'} than the analytic model here[/]")
    if png is not None:
        out.print(f"plot written to {_write_scatter(report, png)}", highlight=False)
    write_json(json_path, {"n_train": report.n_train, "n_test": report.n_test, "analytic_mape": report.analytic_mape,
                           "corrected_mape": report.corrected_mape, "kind": report.kind, "correction_applied": better,
                           "png": None if png is None else str(png),
                           "test": report.test.to_dict(orient="records")})
def _write_scatter(report, path: Path) -> Path:
    from cocoweave.perf.correction import scatter_png

    try:
        return scatter_png(report, path, "cost model: predicted vs measured (held out)")
    except OSError as exc:
        raise CocoweaveError(f"cannot write the plot {path}: {exc.strerror or exc}.") from exc
