"""CLI for the measurement/prediction pillar: `cocoweave perf calibrate|predict|accuracy` (the cost model),
`cocoweave perf cmdare` reproduces CM-DARE's models,
`cocoweave plan` recommends a cluster configuration for a deadline or a budget."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.table import Table

from cocoweave.errors import CocoweaveError

from .common import console, fail

T = TypeVar("T")

perf_app = typer.Typer(help="Performance models: calibrate, predict, accuracy; the CM-DARE reproduction.",
                       no_args_is_help=True, add_completion=False)


@perf_app.callback()
def perf_main() -> None:
    """Performance models: calibrate, predict, accuracy; the CM-DARE reproduction."""


def _run_or_exit(fn: Callable[[], T]) -> T:
    """Run `fn`; a user error prints one sentence and exits with code 2 instead of a traceback."""
    try:
        return fn()
    except CocoweaveError as exc:
        raise fail(str(exc)) from None


def _cell(mapes: list[float]) -> str:
    mean = sum(mapes) / len(mapes)
    return f"{mean:.2f}" if len(mapes) == 1 else f"{mean:.2f} ({mapes[0]:.2f})"


def _mape_table(report, n_seeds: int) -> Table:
    from cocoweave.perf.cmdare import OURS

    table = Table(title=f"MAPE %: random splits show the mean over {n_seeds} seeds (seed 0)",
                  title_justify="left")
    for col in ("Protocol", "Paper SVR", "Paper lin.", "Linear", "SVR", "Ours", "Ours = CV choice"):
        table.add_column(col, justify="left" if col in ("Protocol", "Ours = CV choice") else "right")
    groups: dict[tuple[str, str], dict] = {}
    for res in report.results:
        groups.setdefault((res.protocol, res.scope), {})[res.method] = res
    for (protocol, scope), by_method in groups.items():
        published = {m: r.published for m, r in by_method.items() if r.published is not None}
        ours = by_method[OURS]
        table.add_row(
            f"({protocol}) {scope}",
            *(f"{published[m]:.2f}" if m in published else "—" for m in ("SVR (paper)", "linear (paper)")),
            _cell(by_method["linear (paper)"].mapes), _cell(by_method["SVR (paper)"].mapes),
            f"[bold]{_cell(ours.mapes)}[/]", ours.choice)
    return table


def _mape_legend() -> list[str]:
    from cocoweave.perf.cmdare import PROTOCOLS

    return [
        "; ".join(f"({key}) {name}" for key, name in PROTOCOLS.items()) + ".",
        "Paper: published figures. Linear, SVR: the paper's methods and features re-run here; seed 0 "
        "is the paper's split. Ours: the candidate with the lowest CV MAPE on the training part.",
        "Random splits put runs of the same model in train and test (13 per model), so they measure "
        "interpolation; held-out splits test models never seen in training.",
    ]


def _bottleneck_table(scaling) -> Table:
    import pandas as pd

    bt = scaling.bottlenecks
    workers = sorted(int(c.removeprefix("eff_w")) for c in bt.columns if c.startswith("eff_w"))
    table = Table(title=f"PS bottleneck: measured / linear-scaling throughput %, red below "
                        f"{scaling.threshold:.0%}", title_justify="left")
    for col in ("GPU", "PS", "Model", "1w st/s", *(f"{w}w" for w in workers[1:]), "From"):
        table.add_column(col, justify="left" if col in ("GPU", "Model") else "right")
    for row in bt.itertuples(index=False):
        effs = []
        for w in workers[1:]:
            e = 100 * getattr(row, f"eff_w{w}")
            effs.append(f"[red]{e:.0f}[/]" if e < 100 * scaling.threshold else f"{e:.0f}")
        knee = row.bottleneck_workers
        table.add_row(row.gpu, str(row.ps), row.model, f"{row.single_steps_per_s:.2f}", *effs,
                      "—" if pd.isna(knee) else f"{int(knee)}w")
    return table


def _bottleneck_summary(scaling) -> list[str]:
    lines = []
    top = int(scaling.efficiency["workers"].max())
    for (gpu, ps), grp in scaling.bottlenecks.groupby(["gpu", "ps"]):
        knees = grp["bottleneck_workers"].dropna()
        if knees.empty:
            lines.append(f"{gpu} with {ps} PS: within {scaling.threshold:.0%} of linear scaling for every "
                         f"model up to {top} workers.")
        else:
            lines.append(f"{gpu} with {ps} PS: bottleneck for {len(knees)} of {len(grp)} models, starting at "
                         f"{int(knees.min())} to {int(knees.max())} workers.")
    law = scaling.law
    lines.append(f"Fitted PS law: per global step the parameter servers spend {law.ms_per_tensor:.3f} ms "
                 f"per tensor + bytes at {law.bandwidth_mb_s:.0f} MB/s; p servers give "
                 f"p^{law.ps_exponent:.2f} the capacity.")
    lines.append("Throughput MAPE, PS law vs linear scaling: " + "; ".join(
        f"{k}: {scaling.law_mape[k]:.1f}% vs {scaling.linear_mape[k]:.1f}%" for k in scaling.law_mape) + ".")
    lines.append("PS law fitted without the model it predicts (leave one model out): " + "; ".join(
        f"{k}: {v:.1f}%" for k, v in scaling.leave_one_model_out_mape.items()) + ".")
    return lines


def _startup_table(startup) -> Table:
    table = Table(title="VM startup (provisioning + staging + booting), seconds", title_justify="left")
    for col in ("GPU", "Pricing", "Mean", "Std", "Runs"):
        table.add_column(col, justify="left" if col in ("GPU", "Pricing") else "right")
    for row in startup.itertuples(index=False):
        table.add_row(row.gpu, row.pricing, f"{row.mean:.1f}", f"{row.std:.1f}", str(row.count))
    return table


@perf_app.command("cmdare")
def cmdare_command(
    data: Annotated[Path | None, typer.Option(
        "--data", help="CM-DARE data folder (default: $COCOWEAVE_CMDARE_DATA or shared/data/cmdare "
                       "found above the current directory or the package).")] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Also write all results to this JSON file.")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Random 80/20 splits per protocol (seeds 0..N-1).")] = 5,
    jobs: Annotated[int, typer.Option(help="Parallel processes for the splits (1: sequential).")] = 1,
) -> None:
    """Reproduce CM-DARE's models with the paper's protocols and analyse the parameter-server bottleneck."""
    from cocoweave.perf.cmdare import run
    from cocoweave.perf.cmdare_data import find_data_dir

    start = time.perf_counter()
    data_dir = _run_or_exit(lambda: find_data_dir(data))
    report = _run_or_exit(lambda: run(data_dir, range(seeds), n_jobs=jobs))
    elapsed = time.perf_counter() - start
    console.print(_mape_table(report, seeds))
    for line in _mape_legend():
        console.print(f"[dim]{line}[/]", highlight=False)
    console.print(_bottleneck_table(report.scaling))
    for line in _bottleneck_summary(report.scaling):
        console.print(line, highlight=False)
    console.print(_startup_table(report.startup))
    console.print(f"[dim]data: {data_dir}; {elapsed:.1f} s[/]")
    if json_path is not None:
        doc = report.to_json() | {"data_dir": str(data_dir), "elapsed_s": elapsed}
        _run_or_exit(lambda: _write_json(json_path, doc))
        console.print(f"results written to {json_path}")


def _write_json(path: Path, doc: dict) -> None:
    try:
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    except OSError as exc:
        raise CocoweaveError(f"cannot write {path}: {exc.strerror or exc}.") from exc


def _front_table(plan) -> Table:
    table = Table(title=f"Pareto front (time vs cost) for {plan.steps:,} steps; ★ = recommended",
                  title_justify="left")
    for col in ("", "Configuration", "Step (ms)", "Hours", "Cost ($)", "Checkpoint every", "Revocations"):
        table.add_column(col, justify="left" if col in ("", "Configuration") else "right")
    for opt in plan.front:
        chosen = opt == plan.best
        every = "—" if opt.checkpoint_interval_s is None else f"{opt.checkpoint_interval_s / 60:.1f} min"
        table.add_row("★" if chosen else "", opt.describe(), f"{opt.step_time_s * 1e3:.1f}",
                      f"{opt.hours:.2f}", f"{opt.cost:,.2f}", every, f"{opt.expected_revocations:.2f}",
                      style="bold green" if chosen else None)
    return table


def plan_command(
    steps: Annotated[int, typer.Option("--steps", min=1, help="Global training steps to run.")],
    model: Annotated[str | None, typer.Option(
        "--model", help="CM-DARE model to profile from the fitted models, e.g. resnet-32.")] = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", help="YAML workload profile (step time per GPU and worker count).")] = None,
    catalog: Annotated[Path | None, typer.Option(
        "--catalog", help="YAML machine catalog (default: examples/catalog.yaml found above here).")] = None,
    deadline: Annotated[float | None, typer.Option("--deadline", help="Deadline in HOURS.")] = None,
    budget: Annotated[float | None, typer.Option("--budget", help="Budget in DOLLARS.")] = None,
    max_workers: Annotated[int, typer.Option(min=1, help="Most workers to consider (--model).")] = 8,
    max_ps: Annotated[int, typer.Option(min=1, help="Most parameter servers to consider (--model).")] = 2,
    png: Annotated[Path, typer.Option("--png", help="Where to write the time/cost plot.")] = Path("plan.png"),
    data: Annotated[Path | None, typer.Option("--data", help="CM-DARE data folder (for --model).")] = None,
) -> None:
    """Recommend a cluster for a deadline or a budget (spot overheads counted) and show the Pareto front."""
    from cocoweave.perf.catalog import default_catalog_path, load_catalog
    from cocoweave.perf.cmdare_data import find_data_dir
    from cocoweave.perf.planner import plan as make_plan
    from cocoweave.perf.profile import load_profile, profile_for_model

    def build():
        if (model is None) == (profile is None):
            raise CocoweaveError("give exactly one of --model NAME or --profile FILE.")
        cat = load_catalog(catalog if catalog is not None else default_catalog_path())
        prof = (load_profile(profile) if profile is not None else
                profile_for_model(model, find_data_dir(data), max_workers=max_workers, max_ps=max_ps))
        return prof, make_plan(prof, cat, steps, deadline_h=deadline, budget_usd=budget)

    prof, result = _run_or_exit(build)
    for note in prof.notes:
        console.print(f"[dim]{note}[/]", highlight=False)
    console.print(_front_table(result))
    best = result.best
    constraint = " and ".join(part for part in (
        f"deadline {deadline:g} h" if deadline is not None else "",
        f"budget ${budget:,.2f}" if budget is not None else "") if part)
    every = ("" if best.checkpoint_interval_s is None
             else f", checkpoint every {best.checkpoint_interval_s / 60:.1f} min")
    console.print(f"[bold]Recommended[/] for {prof.name}, {steps:,} steps, {constraint}: "
                  f"[bold green]{best.describe()}[/] — {best.hours:.2f} h, ${best.cost:,.2f}{every}.",
                  highlight=False)
    if result.unfinishable:
        console.print(f"[dim]{result.unfinishable} spot configurations left out: revoked faster than they "
                      "make progress.[/]")
    path = _run_or_exit(lambda: _write_png(result, png, f"{prof.name}: {steps:,} steps"))
    console.print(f"plot written to {path}")


def _write_png(result, path: Path, title: str) -> Path:
    from cocoweave.perf.plan_plot import write_plan_png

    try:
        return write_plan_png(result, path, title)
    except OSError as exc:
        raise CocoweaveError(f"cannot write the plot {path}: {exc.strerror or exc}.") from exc


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
