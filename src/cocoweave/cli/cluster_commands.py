"""CLI of cluster planning: `cocoweave perf cmdare` reproduces CM-DARE's models (registered in the perf
group), `cocoweave plan` recommends a cluster configuration for a deadline or a budget."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cocoweave.errors import CocoweaveError

from .common import console, user_errors


def _cell(mapes: list[float]) -> str:
    mean = sum(mapes) / len(mapes)
    return f"{mean:.2f}" if len(mapes) == 1 else f"{mean:.2f} ({mapes[0]:.2f})"


def _mape_table(report, n_seeds: int) -> Table:
    from cocoweave.cluster.cmdare import OURS

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
    from cocoweave.cluster.cmdare import PROTOCOLS

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


@user_errors
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
    from cocoweave.cluster.cmdare import reproduce
    from cocoweave.cluster.cmdare_data import find_data_dir

    start = time.perf_counter()
    data_dir = find_data_dir(data)
    report = reproduce(data_dir, range(seeds), n_jobs=jobs)
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
        _write_json(json_path, doc)
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


@user_errors
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
    from cocoweave.cluster.catalog import default_catalog_path, load_catalog
    from cocoweave.cluster.cmdare_data import find_data_dir
    from cocoweave.cluster.planner import plan_cluster
    from cocoweave.cluster.workload_profile import load_profile, profile_for_model

    def build():
        if (model is None) == (profile is None):
            raise CocoweaveError("give exactly one of --model NAME or --profile FILE.")
        cat = load_catalog(catalog if catalog is not None else default_catalog_path())
        prof = (load_profile(profile) if profile is not None else
                profile_for_model(model, find_data_dir(data), max_workers=max_workers, max_ps=max_ps))
        return prof, plan_cluster(prof, cat, steps, deadline_h=deadline, budget_usd=budget)

    prof, result = build()
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
    path = _write_png(result, png, f"{prof.name}: {steps:,} steps")
    console.print(f"plot written to {path}")


def _write_png(result, path: Path, title: str) -> Path:
    from cocoweave.cluster.plan_plot import write_plan_png

    try:
        return write_plan_png(result, path, title)
    except OSError as exc:
        raise CocoweaveError(f"cannot write the plot {path}: {exc.strerror or exc}.") from exc


