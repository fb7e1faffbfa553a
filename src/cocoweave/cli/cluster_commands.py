"""CLI of cluster planning: `cocoweave perf cmdare` reproduces CM-DARE's models (registered in the perf
group), `cocoweave plan` recommends a cluster configuration for a deadline or a budget."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cocoweave.errors import CocoweaveError

from .common import user_errors
from .json_output import JsonOpt, check_writable, human, write_json


def _cell(result) -> str:
    if result is None:
        return "—"
    mapes = result.mapes
    mean = sum(mapes) / len(mapes)
    return f"{mean:.2f}" if len(mapes) == 1 else f"{mean:.2f} ({mapes[0]:.2f})"


def _mape_table(report, n_seeds: int) -> Table:
    from cocoweave.cluster.cmdare.reproduce import OURS, PER_MODEL_MEAN

    table = Table(title=f"MAPE %, held-out models first; random splits show the mean over {n_seeds} seeds "
                        "(seed 0)", title_justify="left")
    for col in ("Protocol", "Per-model mean", "Paper SVR", "Paper lin.", "Linear", "SVR", "Ours", "Ours = CV choice"):
        table.add_column(col, justify="left" if col in ("Protocol", "Ours = CV choice") else "right")
    groups: dict[tuple[str, str], dict] = {}
    for res in report.results:
        groups.setdefault((res.protocol, res.scope), {})[res.method] = res
    for (protocol, scope), by_method in groups.items():
        published = {m: r.published for m, r in by_method.items() if r.published is not None}
        ours = by_method[OURS]
        table.add_row(
            f"({protocol}) {scope}", _cell(by_method.get(PER_MODEL_MEAN)),
            *(f"{published[m]:.2f}" if m in published else "—" for m in ("SVR (paper)", "linear (paper)")),
            _cell(by_method["linear (paper)"]), _cell(by_method["SVR (paper)"]),
            f"[bold]{_cell(ours)}[/]", ours.choice)
    return table


def _mape_legend() -> list[str]:
    from cocoweave.cluster.cmdare.reproduce import PROTOCOLS

    return [
        "; ".join(f"({key}) {name}" for key, name in PROTOCOLS.items()) + ".",
        "Held-out splits test models never seen in training: the figures that say how well a new model is "
        "predicted. Random splits put repeats of every model (13 per model and GPU, 5 checkpoints) on both sides, "
        "so they measure the noise between repeats: predicting each test row by the mean of its model's "
        "training repeats (per-model mean) does as well as any model there.",
        "Paper: published figures. Linear, SVR: the paper's methods and features re-run here; seed 0 "
        "is the paper's split. Ours: the candidate with the lowest CV MAPE on the training part.",
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
        "--data", help="CM-DARE data folder (default: $COCOWEAVE_CMDARE_DATA, else the copy shipped with "
                       "cocoweave).")] = None,
    json_path: JsonOpt = None,
    seeds: Annotated[int, typer.Option(min=1, help="Random 80/20 splits per protocol (seeds 0..N-1).")] = 5,
    jobs: Annotated[int, typer.Option(min=1, help="Parallel processes for the splits (1: sequential).")] = 1,
) -> None:
    """Reproduce CM-DARE's models with the paper's protocols and analyse the parameter-server bottleneck."""
    from cocoweave.cluster.cmdare.reproduce import reproduce
    from cocoweave.cluster.cmdare.tables import find_data_dir

    check_writable(json_path)
    out = human(json_path)
    start = time.perf_counter()
    data_dir = find_data_dir(data)
    report = reproduce(data_dir, range(seeds), n_jobs=jobs)
    elapsed = time.perf_counter() - start
    out.print(_mape_table(report, seeds))
    for line in _mape_legend():
        out.print(f"[dim]{line}[/]", highlight=False)
    out.print(_bottleneck_table(report.scaling))
    for line in _bottleneck_summary(report.scaling):
        out.print(line, highlight=False)
    out.print(_startup_table(report.startup))
    out.print(f"[dim]data: {data_dir}; {elapsed:.1f} s[/]", highlight=False)
    write_json(json_path, report.to_json() | {"data_dir": str(data_dir), "elapsed_s": elapsed})


def _front_table(plan, modelled: bool) -> Table:
    title = f"Pareto front (time vs cost) for {plan.steps:,} steps; ★ = recommended"
    table = Table(title=title + ("; MODELLED step times" if modelled else ""), title_justify="left")
    for col in ("", "Configuration", "Step (ms)", "Hours", "Cost ($)", "Checkpoint every", "Revocations"):
        table.add_column(col, justify="left" if col in ("", "Configuration") else "right")
    for opt in plan.front:
        chosen = opt == plan.best
        every = "—" if opt.checkpoint_interval_s is None else f"{opt.checkpoint_interval_s / 60:.1f} min"
        table.add_row("★" if chosen else "", opt.describe(), f"{opt.step_time_s * 1e3:.3g}",
                      f"{opt.hours:.2f}", f"{opt.cost:,.2f}", every, f"{opt.expected_revocations:.2f}",
                      style="bold green" if chosen else None)
    return table


def _option_json(opt) -> dict:
    return {"machine": opt.machine.name, "gpu": opt.machine.gpu, "pricing": opt.pricing, "workers": opt.workers,
            "nodes": opt.machine.nodes(opt.workers), "parameter_servers": opt.ps, "step_time_s": opt.step_time_s,
            "hours": opt.hours, "cost_usd": opt.cost, "checkpoint_interval_s": opt.checkpoint_interval_s,
            "expected_revocations": opt.expected_revocations}


def _load_profile(path: Path, catalog, max_workers: int, data: Path | None):
    """A YAML workload profile, or the JSON `cocoweave profile` wrote (then also its train steps and PNG path)."""
    from cocoweave.cluster.cmdare.tables import find_data_dir
    from cocoweave.cluster.planning.checkpoint_model import fit_checkpoint_model
    from cocoweave.cluster.planning.step_times import parse_profile
    from cocoweave.cluster.profiling.run_profile import KIND, RunProfile, worker_counts
    from cocoweave.cluster.yamlio import load_yaml

    try:  # JSON first: YAML 1.1 reads JSON's 1e-05 as a string
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        doc = load_yaml(path, "profile")
    if not (isinstance(doc, dict) and doc.get("kind") == KIND):
        return parse_profile(doc, str(path)), None
    run = RunProfile.from_json(doc, str(path))
    measured = run.checkpoint_measured()
    if measured is not None:  # the user's own checkpoint, as the profiled script took it
        seconds, size_bytes, operation = measured
        note = (f"checkpoint: {seconds:.3f} s MEASURED in the profiled run ({operation}, {size_bytes / 1e6:.2f} MB, "
                f"{size_bytes / 1e6 / seconds:.0f} MB/s on this host), used for the revocation overhead and Young's "
                "checkpoint interval")
    else:
        size_bytes, how = run.checkpoint_bytes()
        ckpt = fit_checkpoint_model(find_data_dir(data))
        seconds = ckpt.duration_s(size_bytes / 1e6)
        note = (f"checkpoint: {size_bytes / 1e6:.2f} MB ({how}) -> {seconds:.2f} s from CM-DARE's checkpoint model "
                f"({ckpt.selection.name}; sizes below its smallest measured, {ckpt.min_size_mb:g} MB, priced at that "
                "size): the profiled run saved no checkpoint")
    prof = run.workload(catalog, worker_counts(max_workers), seconds)
    return dataclasses.replace(prof, notes=(*prof.notes, note)), run


@user_errors
def plan_command(
    steps: Annotated[int | None, typer.Option(
        "--steps", min=1, help="Global training steps to run (default for a `cocoweave profile` JSON: the train "
                               "steps it names).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="CM-DARE model to profile from the fitted models, e.g. resnet-32.")] = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", help="The JSON `cocoweave profile` wrote, or a YAML workload profile (step time per GPU and "
                          "worker count).")] = None,
    catalog: Annotated[Path | None, typer.Option(
        "--catalog", help="YAML machine catalog (default: the one shipped with cocoweave).")] = None,
    deadline: Annotated[float | None, typer.Option("--deadline", help="Deadline in HOURS.")] = None,
    budget: Annotated[float | None, typer.Option("--budget", help="Budget in DOLLARS.")] = None,
    max_workers: Annotated[int | None, typer.Option(
        min=1, help="Most workers (GPUs) to consider (default: 8 for --model, 64 for a profiled run).")] = None,
    max_ps: Annotated[int, typer.Option(min=1, help="Most parameter servers to consider (--model).")] = 2,
    png: Annotated[Path | None, typer.Option(
        "--png", help="Where to write the time/cost plot (default: beside a profiled run's JSON; none for "
                      "--model or a YAML profile).")] = None,
    json_path: JsonOpt = None,
    data: Annotated[Path | None, typer.Option("--data", help="CM-DARE data folder (default: the shipped copy).")]
    = None,
    llm: Annotated[Path | None, typer.Option(
        "--llm", help="A transformer spec (YAML: layers, hidden, heads, vocab, seq_len, global_batch...; or a "
                      "Hugging Face config.json plus seq_len and global_batch): plan its tp x pp x dp layout, "
                      "machine and GPU count from the catalog.")] = None,
    tokens: Annotated[float | None, typer.Option(
        "--tokens", help="Tokens to train (--llm), e.g. 3e11.")] = None,
    stack: Annotated[str, typer.Option(
        "--stack", help="Software stack whose layouts and calibrated efficiency --llm assumes: megatron-2022, "
                        "megatron-2021 or torchtitan-2024 (calibrated on A100); megatron-core-2024, "
                        "megatron-bridge-2025, torchtitan-compile-2024 or llm-foundry-2023 (calibrated on H100; "
                        "docs/planning_llm.md).")
    ] = "megatron-2022",
    max_gpus: Annotated[int, typer.Option("--max-gpus", min=1, help="Most GPUs --llm considers.")] = 4096,
    resizes: Annotated[str | None, typer.Option(
        "--resizes", help="A resize schedule RANKS:HOURS,...,RANKS (e.g. 8:2,4:1.5,8): also predict the job's "
                          "hours and dollars on the recommended machine when its workers change so, under "
                          "keep_global and under scale (linear lr), a checkpoint and a restart at every resize.")]
    = None,
) -> None:
    """Recommend a cluster for a deadline or a budget (spot overheads counted) and show the Pareto front."""
    from cocoweave.cluster.catalog import load_catalog
    from cocoweave.cluster.cmdare.tables import find_data_dir
    from cocoweave.cluster.planning.planner import plan_cluster, resize_predictions
    from cocoweave.cluster.planning.resize import parse_resize_plan
    from cocoweave.cluster.planning.step_times import profile_for_model

    check_writable(json_path)
    out = human(json_path)
    resize_plan = parse_resize_plan(resizes) if resizes is not None else None
    if sum(x is not None for x in (model, profile, llm)) != 1:
        raise CocoweaveError("give exactly one of --model NAME, --profile FILE or --llm SPEC.")
    if llm is not None:
        if resize_plan is not None or steps is not None:
            raise CocoweaveError("--llm plans by --tokens and has no resize schedule: leave out --steps and --resizes.")
        _plan_llm_command(out, llm, tokens, catalog, deadline, budget, stack, max_gpus, png, json_path, data)
        return
    cat = load_catalog(catalog)
    run = None
    if profile is not None:
        prof, run = _load_profile(profile, cat, max_workers or 64, data)
    else:
        prof = profile_for_model(model, find_data_dir(data), max_workers=max_workers or 8, max_ps=max_ps)
    if steps is None and run is None:
        raise CocoweaveError("give --steps N (the training steps to plan for).")
    n_steps = steps if steps is not None else run.train_steps
    result = plan_cluster(prof, cat, n_steps, deadline_h=deadline, budget_usd=budget)
    if png is None and run is not None:
        png = profile.with_name(f"{profile.stem}-plan.png")
    for note in prof.notes:
        out.print(f"[dim]{note}[/]", highlight=False)
    out.print(_front_table(result, prof.modelled))
    best = result.best
    constraint = " and ".join(part for part in (
        f"deadline {deadline:g} h" if deadline is not None else "",
        f"budget ${budget:,.2f}" if budget is not None else "") if part)
    every = ("" if best.checkpoint_interval_s is None
             else f", checkpoint every {best.checkpoint_interval_s / 60:.1f} min")
    label = " (modelled)" if prof.modelled else ""
    out.print(f"[bold]Recommended[/] for {prof.name}, {n_steps:,} steps, {constraint}: "
              f"[bold green]{best.describe()}[/] — {best.hours:.2f} h, ${best.cost:,.2f}{every}{label}.",
              highlight=False)
    if result.unfinishable:
        out.print(f"[dim]{result.unfinishable} spot configurations left out: revoked faster than they "
                  "make progress.[/]")
    elastic = {} if resize_plan is None else resize_predictions(prof, best, n_steps, resize_plan)
    if elastic:
        out.print(_resize_table(elastic, best))
        for name, pred in elastic.items():
            state = (f"finishes in {pred.hours:.2f} h for ${pred.cost:,.2f}" if pred.finished else
                     f"does not finish: the schedule ends after {pred.progress:,.0f} of {n_steps:,} steps")
            out.print(f"Under the resize schedule {resizes} on {best.machine.name} ({best.pricing}), {name} "
                      f"{state}, {pred.lost_steps} steps lost at resizes.", highlight=False)
    if png is not None:
        path = _write_png(result, png, f"{prof.name}: {n_steps:,} steps" + label)
        out.print(f"plot written to {path}", highlight=False)
    else:
        out.print("[dim]pass --png PATH for the time/cost plot[/]")
    write_json(json_path, {
        "profile": prof.name, "modelled": prof.modelled, "notes": list(prof.notes), "steps": n_steps,
        "deadline_h": deadline, "budget_usd": budget, "catalog": cat.source,
        "recommended": _option_json(best), "pareto_front": [_option_json(o) for o in result.front],
        "options": len(result.options), "unfinishable_spot": result.unfinishable,
        "png": None if png is None else str(png),
        "resizes": None if not elastic else _resize_json(elastic, resizes, best)})


def _resize_table(predictions: dict, best) -> Table:
    table = Table(title=f"Resize schedule on {best.machine.name} ({best.pricing})")
    for col in ("policy", "workers", "hours", "steps", "kept", "progress", "cost $"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, pred in predictions.items():
        for p in pred.phases:
            table.add_row(name, str(p.world), f"{p.hours:.2f}", f"{p.steps:,}", f"{p.kept:,}", f"{p.progress:,.0f}",
                          f"{p.cost:,.2f}")
    return table


def _resize_json(predictions: dict, text: str, best) -> dict:
    return {"schedule": text, "machine": best.machine.name, "pricing": best.pricing, "policies": {
        name: {"finished": pred.finished, "hours": pred.hours, "cost_usd": pred.cost, "steps_run": pred.steps,
               "lost_steps": pred.lost_steps, "progress": pred.progress,
               "phases": [{"workers": p.world, "hours": p.hours, "steps": p.steps, "kept": p.kept,
                           "progress": p.progress, "cost_usd": p.cost} for p in pred.phases]}
        for name, pred in predictions.items()}}


def _write_png(result, path: Path, title: str) -> Path:
    from cocoweave.cluster.planning.plot import write_plan_png

    try:
        return write_plan_png(result, path, title)
    except OSError as exc:
        raise CocoweaveError(f"cannot write the plot {path}: {exc.strerror or exc}.") from exc


def _plan_llm_command(out, spec_path: Path, tokens: float | None, catalog: Path | None, deadline: float | None,
                      budget: float | None, stack_name: str, max_gpus: int, png: Path | None, json_path, data) -> None:
    """`plan --llm`: the recommended machine, GPU count and layout, its terms and memory, and the Pareto front."""
    from cocoweave.cluster.catalog import load_catalog
    from cocoweave.cluster.cmdare.tables import find_data_dir
    from cocoweave.cluster.planning.checkpoint_model import fit_checkpoint_model
    from cocoweave.cluster.planning.llm.plan import check_max_gpus, plan_llm
    from cocoweave.cluster.planning.llm.spec import load_spec
    from cocoweave.cluster.planning.llm.system import STACKS

    if tokens is None:
        raise CocoweaveError("give --tokens N (the tokens to train) with --llm.")
    check_max_gpus(max_gpus)  # before the checkpoint model is fitted (seconds) and the spec read
    if stack_name not in STACKS:
        raise CocoweaveError(f"unknown --stack {stack_name!r}; known: {', '.join(STACKS)}.")
    spec = load_spec(spec_path)
    cat = load_catalog(catalog)
    result = plan_llm(spec, cat, tokens, STACKS[stack_name], fit_checkpoint_model(find_data_dir(data)),
                      deadline_h=deadline, budget_usd=budget, max_gpus=max_gpus)
    for note in result.notes:
        out.print(f"[dim]{note}[/]", highlight=False)
    out.print(_llm_front_table(result))
    best = result.plan.best
    chosen = result.layout(best)
    step = chosen.step
    constraint = " and ".join(part for part in (
        f"deadline {deadline:g} h" if deadline is not None else "",
        f"budget ${budget:,.2f}" if budget is not None else "") if part)
    out.print(f"[bold]Recommended[/] for {spec.name}, {tokens:.3g} tokens, {constraint}: [bold green]"
              f"{best.workers} x {best.machine.gpu} {best.pricing} ({best.machine.name}), {chosen.cfg.describe()}"
              f"[/] — step {step.total_s:.2f} s, MFU {step.mfu:.1%}, {step.memory.total / 1e9:.1f} GB per GPU, "
              f"{best.hours:.1f} h, ${best.cost:,.0f} (modelled).", highlight=False)
    out.print("Step terms (s): " + ", ".join(f"{k} {v:.2f}" for k, v in _terms(step).items()) + "; memory (GB): "
              + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in _memory(step).items()) + ".", highlight=False)
    if png is not None:
        path = _write_png(result.plan, png, f"{spec.name}: {tokens:.3g} tokens (modelled)")
        out.print(f"plot written to {path}", highlight=False)
    else:
        out.print("[dim]pass --png PATH for the time/cost plot[/]")
    write_json(json_path, {
        "llm": spec.model_dump(), "tokens": tokens, "stack": result.stack, "steps": result.plan.steps,
        "deadline_h": deadline, "budget_usd": budget, "catalog": cat.source, "notes": list(result.notes),
        "recommended": _llm_option_json(result, best),
        "pareto_front": [_llm_option_json(result, o) for o in result.plan.front],
        "options": len(result.plan.options), "unfinishable_spot": result.plan.unfinishable,
        "unfit": [{"machine": m, "gpus": n, "reason": why} for (m, n), why in result.unfit.items()],
        "png": None if png is None else str(png)})


def _terms(step) -> dict[str, float]:
    return {"compute": step.compute_s, "tp exposed": step.tp_comm_s, "cp exposed": step.cp_comm_s,
            "ep all-to-all": step.ep_comm_s, "pp p2p": step.pp_comm_s, "bubble": step.bubble_s,
            "dp exposed": step.dp_exposed_s, "optimizer": step.optimizer_s}


def _memory(step) -> dict[str, float]:
    m = step.memory
    return {"weights": m.weights, "gradients": m.gradients, "optimizer": m.optimizer, "activations": m.activations,
            "workspace": m.workspace}


def _llm_option_json(result, opt) -> dict:
    chosen = result.layout(opt)
    cfg, step = chosen.cfg, chosen.step
    return _option_json(opt) | {
        "layout": {"tp": cfg.tp, "cp": cfg.cp, "pp": cfg.pp, "vp": cfg.vp, "dp": cfg.dp, "ep": cfg.ep,
                   "micro_batch": cfg.micro_batch,
                   "zero": cfg.zero, "sequence_parallel": cfg.sp, "recompute": cfg.recompute},
        "mfu": step.mfu, "terms_s": _terms(step), "memory_bytes": _memory(step),
        "memory_per_gpu_bytes": step.memory.total}


def _llm_front_table(result) -> Table:
    plan = result.plan
    table = Table(title=f"Pareto front (time vs cost), {plan.steps:,} steps; ★ = recommended; MODELLED step times",
                  title_justify="left")
    for col in ("", "GPUs", "Machine", "Pricing", "Layout", "Step (s)", "MFU", "GB/GPU", "Hours", "Cost ($)"):
        table.add_column(col, justify="left" if col in ("", "Machine", "Pricing", "Layout") else "right")
    for opt in plan.front:
        chosen = result.layout(opt)
        mark = opt == plan.best
        table.add_row("★" if mark else "", str(opt.workers), opt.machine.name, opt.pricing, chosen.cfg.describe(),
                      f"{chosen.step.total_s:.2f}", f"{chosen.step.mfu:.1%}", f"{chosen.step.memory.total / 1e9:.1f}",
                      f"{opt.hours:,.1f}", f"{opt.cost:,.0f}", style="bold green" if mark else None)
    return table
