"""The demo's outputs: rich tables for the terminal, and runs/demo-<UTC time>/ with report.md, results.json,
bars.png (step time per schedule and baseline) and trace.json (Chrome/Perfetto trace of each fastest schedule)."""

from __future__ import annotations

import math
import os
import platform
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from .. import jsonable
from ..perf.trace import merge_and_write
from ..rankenv import cores
from ..version import __version__
from .runner import BaselineRow, DemoResult, Row, WorkloadResult


def machine() -> dict[str, Any]:
    """Where the demo ran: CPU, cores, GPU, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # other work on the machine skews timings
    return {"host": platform.node(), "os": platform.platform(), "cpu": cpu, "cores": cores(), "gpu": gpu, "load": load,
            "python": platform.python_version(), "torch": torch.__version__, "cocoweave": __version__}


def _ms(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "-"


def _speedup(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "-"


def _checked(row: Row) -> str:
    if row.checked:
        return f"yes (max err {row.max_abs:.1e})"
    return f"NO: {row.error}" if row.error else "NO"


NOT_HEADLINE = "keeps {names} sliced: timed with its all-gather; not the headline"


def _note(row: Row) -> str:
    return NOT_HEADLINE.format(names=", ".join(row.gathers)) if row.gathers else ""


ROUTES = {"torch": "fused stages ran op by op (torch calls)", "triton": "fused stages ran as generated Triton kernels",
          "compiled": "fused stages ran as one compiled loop each (torch.compile)"}


def route(result: DemoResult) -> str:
    """How the fused stages ran, in words."""
    if result.kernels == "auto":
        return ("fused stages ran as generated Triton kernels" if result.device == "cuda" else
                "fused stages ran as one compiled loop each (torch.compile: Inductor's C++)")
    return ROUTES.get(result.kernels, f"fused stages took route {result.kernels!r}")


def summary(result: DemoResult) -> list[str]:
    """The two sentences on top of the report: what was proven, and what was timed."""
    shown = [w for w in result.workloads if not w.skipped]
    rows = [r for w in shown for r in w.rows]
    ok = sum(r.checked for r in rows)
    n = f"{result.world_size} rank{'s' if result.world_size != 1 else ''}"
    proven = (f"Proven: {ok} of {len(rows)} schedules of {len(shown)} workload{'s' if len(shown) != 1 else ''} "
              f"compute what their program as written computes, on {result.check_inputs} random input sets at small "
              f"sizes on the reference backend ({n} simulated) and on one at the timed sizes on the torch "
              f"backend ({n} live, {result.backend} on {result.device}, running the very code that was timed; "
              f"{route(result)}).")
    timed = (f"Timed: each schedule and each plain PyTorch baseline, median over {result.iters} steps (after "
             f"{result.warmup} warm-up steps) of the slowest rank, with a fresh dropout mask every step; the headline "
             "is the fastest schedule that leaves the weights whole against the strongest baseline, and a schedule "
             "that keeps the weights sliced is timed with the all-gather the next forward needs.")
    return [proven, timed]


def headline(w: WorkloadResult) -> str:
    """One line: the workload's fastest whole-weights schedule against its strongest baseline."""
    best = w.fastest
    if w.skipped or best is None:
        return f"{w.key}: " + (f"skipped: {w.skipped}" if w.skipped else "no checked schedule keeps the weights whole")
    return (f"{w.key}: {best.schedule} {_ms(best.ms)} ms, {_speedup(best.speedup)} the strongest baseline "
            f"({w.baseline}, {_ms(w.baseline_ms)} ms)")


def title(w: WorkloadResult) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in w.sizes.items())
    return f"{w.key}: {w.title} ({sizes}, {w.dtype})"


def _baseline_cells(w: WorkloadResult, b: BaselineRow) -> list[str]:
    strongest = b.name == w.baseline
    return [f"baseline: {b.name}", _ms(b.ms), _speedup(w.baseline_ms / b.ms), "-",
            "the strongest baseline" if strongest else ""]


def rich_table(w: WorkloadResult) -> Table:
    """The terminal table of one workload: the baselines, then every schedule; the headline in bold."""
    table = Table(title=title(w), title_justify="left")
    for col, just in (("schedule", "left"), ("ms", "right"), ("vs strongest baseline", "right"),
                      ("checked", "left"), ("note", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    if w.skipped:
        table.add_row(f"skipped: {w.skipped}", "", "", "", "")
        return table
    for b in w.baselines:
        table.add_row(*_baseline_cells(w, b), style="dim")
    best = w.fastest
    table.caption = "headline: " + headline(w).split(": ", 1)[1]
    for r in w.rows:
        style = "bold green" if r is best else ("red" if not r.checked else ("yellow" if r.gathers else None))
        table.add_row(r.schedule, _ms(r.ms), _speedup(r.speedup), "yes" if r.checked else _checked(r), _note(r),
                      style=style)
    return table


def _markdown_table(w: WorkloadResult) -> list[str]:
    if w.skipped:
        return [f"Skipped: {w.skipped}.", ""]
    best = w.fastest
    lines = ["| schedule | ms | vs strongest baseline | checked | note |", "|---|---:|---:|---|---|"]
    lines += ["| " + " | ".join(_baseline_cells(w, b)) + " |" for b in w.baselines]
    for r in w.rows:
        name = f"**{r.schedule}**" if r is best else r.schedule
        lines.append(f"| {name} | {_ms(r.ms)} | {_speedup(r.speedup)} | {_checked(r)} | {_note(r)} |")
    return lines + [""]


def markdown(result: DemoResult, command: str, info: dict[str, Any]) -> str:
    """report.md: what was proven and timed, how it ran, then one table per workload."""
    lines = [
        "# cocoweave demo", "", *summary(result), "",
        *[f"- {headline(w)}" for w in result.workloads], "",
        f"- command: `{command}`",
        f"- date (UTC): {info['date']}",
        f"- world: {result.world_size} ranks, {result.backend} on {result.device}; "
        f"{result.iters} timed steps after {result.warmup} warm-up steps per schedule and baseline",
        f"- machine: {info['machine']['cpu']}, {info['machine']['cores']} cores"
        + (f", GPU {info['machine']['gpu']}" if info["machine"]["gpu"] else "") + f", {info['machine']['os']}"
        + (f"; load average {info['machine']['load']:.1f} (1 min) at the end" if info["machine"]["load"] is not None
           else ""),
        f"- versions: python {info['machine']['python']}, torch {info['machine']['torch']}, "
        f"cocoweave {info['machine']['cocoweave']}",
        f"- wall time: {result.start_s:.1f} s to start the world, {result.total_s:.1f} s for the workloads",
        "",
        "ms: median step time over the timed steps, of the slowest rank (each step starts after a barrier). "
        "vs strongest baseline: the strongest (fastest) baseline's ms / this row's ms. checked: the schedule's "
        "outputs and state equal the program as written's on the reference backend (every rank simulated, "
        f"{result.check_inputs} random input sets at the check sizes) and, on the torch backend, the first step of "
        "the executable that was then timed equals them at the timed sizes. Each baseline's ms is the lower of two "
        "runs (before and after the schedules); a torch.compile'd baseline is compiled once per world, before its "
        "timed steps. The baselines' dropout draws torch's random mask (F.dropout, fresh each step), the schedules "
        "cocoweave's counter-based one with a new seed each step (the same work). The headline schedule is in bold; "
        "its last step is in trace.json (open in ui.perfetto.dev). The model- and pipeline-parallel workloads run "
        "in fp16 on GPUs, as in CoCoNet, and in fp32 on CPUs, where fp16 matmuls are emulated.", "",
        "![step time per schedule](bars.png)", "",
    ]
    for w in result.workloads:
        sizes = ", ".join(f"{k}={v}" for k, v in w.sizes.items())
        check = ", ".join(f"{k}={v}" for k, v in w.check_sizes.items())
        lines += [f"## {w.key}: {w.title}", "",
                  f"{w.dtype}, timed at {sizes}; checked at {check} (reference) and {sizes} (torch). "
                  f"Strongest baseline: {w.baseline}. Checking, compiling and timing it took {w.wall_s:.1f} s.", ""]
        if not w.skipped:
            lines += [f"Headline: {headline(w).split(': ', 1)[1]}.", ""]
        lines += _markdown_table(w)
    return "\n".join(lines)


def bar_chart(result: DemoResult, path: Path) -> None:
    """bars.png: one panel per workload, a bar per baseline and per schedule (ms); the headline green, schedules
    that keep the weights sliced hatched."""
    from ..figures import figure

    shown = [w for w in result.workloads if not w.skipped]
    heights = [len(w.rows) + len(w.baselines) for w in shown] or [1]
    height = 1.2 + 0.24 * sum(heights) + 0.8 * len(heights)
    fig = figure(figsize=(9, height))
    axes = fig.subplots(len(shown) or 1, 1, gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, w in zip(axes[:, 0], shown):
        labels = [f"baseline: {b.name}" for b in w.baselines] + [r.schedule for r in w.rows]
        values = [b.ms if math.isfinite(b.ms) else 0.0 for b in w.baselines] + \
                 [r.ms if math.isfinite(r.ms) else 0.0 for r in w.rows]
        best = w.fastest
        colors = ["#555555" if b.name == w.baseline else "#aaaaaa" for b in w.baselines] + \
                 ["#2ca02c" if r is best else ("#d62728" if not r.checked else "#1f77b4") for r in w.rows]
        y = range(len(labels))
        bars = ax.barh(y, values, color=colors)
        for bar, r in zip(bars[len(w.baselines):], w.rows):
            if r.gathers:
                bar.set_hatch("///")
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title(w), fontsize=9, loc="left")
        ax.set_xlabel("ms per step (median, slowest rank); hatched: weights kept sliced, their all-gather timed too",
                      fontsize=8)
        for i, (v, r) in enumerate(zip(values[len(w.baselines):], w.rows), start=len(w.baselines)):
            if math.isfinite(r.speedup):
                ax.text(v, i, f" {r.speedup:.2f}x", va="center", fontsize=6)
    fig.suptitle(f"cocoweave demo: {result.world_size} ranks, {result.backend} on {result.device}; "
                 "x: vs the strongest baseline", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / height))  # room for the title above the first panel's
    fig.savefig(path, dpi=110)


def _headline_json(w: WorkloadResult) -> dict[str, Any] | None:
    best = w.fastest
    if best is None:
        return None
    return {"schedule": best.schedule, "ms": best.ms, "baseline": w.baseline, "baseline_ms": w.baseline_ms,
            "speedup": best.speedup}


def write_report(result: DemoResult, out_root: str | os.PathLike[str], command: str | None = None) -> Path:
    """Write runs/demo-<UTC time>/ under `out_root` with report.md, results.json, bars.png, trace.json."""
    now = datetime.now(UTC)
    out = Path(out_root) / f"demo-{now:%Y%m%d-%H%M%S}"
    suffix = 1
    while out.exists():
        out = Path(out_root) / f"demo-{now:%Y%m%d-%H%M%S}-{suffix}"
        suffix += 1
    out.mkdir(parents=True)
    command = command or " ".join(["cocoweave", *sys.argv[1:]])
    info = {"date": now.isoformat(timespec="seconds"), "machine": machine(), "command": command}
    (out / "report.md").write_text(markdown(result, command, info), encoding="utf-8")
    data = {**info, "world_size": result.world_size, "device": result.device, "backend": result.backend,
            "iters": result.iters, "warmup": result.warmup, "quick": result.quick, "kernels": result.kernels,
            "check_inputs": result.check_inputs, "start_s": result.start_s, "total_s": result.total_s,
            "summary": summary(result), "headlines": {w.key: _headline_json(w) for w in result.workloads},
            "workloads": [asdict(w) for w in result.workloads]}
    (out / "results.json").write_text(jsonable.dumps(data, indent=1), encoding="utf-8")
    bar_chart(result, out / "bars.png")
    merge_and_write(result.events, out / "trace.json")
    return out
