"""The demo's outputs: rich tables for the terminal, and runs/demo-<UTC time>/ with report.md, results.json,
bars.png (step time per schedule and baseline) and trace.json (Chrome/Perfetto trace of each fastest schedule)."""

from __future__ import annotations

import json
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

from ..trace import merge_and_write
from ..version import __version__
from .runner import DemoResult, WorkloadResult


def machine() -> dict[str, Any]:
    """Where the demo ran: CPU, cores, GPU, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # other work on the machine skews timings
    return {"host": platform.node(), "os": platform.platform(), "cpu": cpu, "cores": cores, "gpu": gpu, "load": load,
            "python": platform.python_version(), "torch": torch.__version__, "cocoweave": __version__}


def _ms(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "-"


def _speedup(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "-"


def _checked(row: Any) -> str:
    if row.checked:
        return f"yes (reference + torch, max err {row.max_abs:.1e})"
    return f"NO: {row.error}"


def title(w: WorkloadResult) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in w.sizes.items())
    return f"{w.key}: {w.title} ({sizes}, {w.dtype})"


def rich_table(w: WorkloadResult) -> Table:
    """The terminal table of one workload: the baseline, then every schedule; the fastest in bold."""
    table = Table(title=title(w), title_justify="left")
    for col, just in (("schedule", "left"), ("ms", "right"), ("speedup", "right"), ("checked", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    if w.skipped:
        table.add_row(f"skipped: {w.skipped}", "", "", "")
        return table
    table.add_row(f"baseline: {w.baseline}", _ms(w.baseline_ms), "1.00x", "-", style="dim")
    best = w.fastest
    if best is not None:
        table.caption = f"fastest: {best.schedule}, {_ms(best.ms)} ms, {_speedup(best.speedup)} the baseline"
    for r in w.rows:
        style = "bold green" if r is best else ("red" if not r.checked else None)
        table.add_row(r.schedule, _ms(r.ms), _speedup(r.speedup), "yes" if r.checked else f"NO: {r.error}",
                      style=style)
    return table


def _markdown_table(w: WorkloadResult) -> list[str]:
    if w.skipped:
        return [f"Skipped: {w.skipped}.", ""]
    best = w.fastest
    lines = ["| schedule | ms | speedup | checked |", "|---|---:|---:|---|",
             f"| baseline: {w.baseline} | {_ms(w.baseline_ms)} | 1.00x | - |"]
    for r in w.rows:
        name = f"**{r.schedule}**" if r is best else r.schedule
        lines.append(f"| {name} | {_ms(r.ms)} | {_speedup(r.speedup)} | {_checked(r)} |")
    return lines + [""]


def markdown(result: DemoResult, command: str, info: dict[str, Any]) -> str:
    """report.md: how it ran, then one table per workload."""
    lines = [
        "# cocoweave demo", "",
        f"- command: `{command}`",
        f"- date (UTC): {info['date']}",
        f"- world: {result.world_size} ranks, {result.backend} on {result.device}; "
        f"{result.iters} timed steps after {result.warmup} warm-up steps per schedule",
        f"- machine: {info['machine']['cpu']}, {info['machine']['cores']} cores"
        + (f", GPU {info['machine']['gpu']}" if info["machine"]["gpu"] else "") + f", {info['machine']['os']}"
        + (f"; load average {info['machine']['load']:.1f} (1 min) at the end" if info["machine"]["load"] is not None
           else ""),
        f"- versions: python {info['machine']['python']}, torch {info['machine']['torch']}, "
        f"cocoweave {info['machine']['cocoweave']}",
        f"- wall time: {result.start_s:.1f} s to start the world, {result.total_s:.1f} s for the workloads",
        "",
        "ms: median step time over the timed steps, of the slowest rank (each step starts after a barrier). "
        "speedup: baseline ms / schedule ms. checked: the schedule's outputs and state equal the program as "
        "written (reference backend, every rank simulated) and the torch backend on this world computes the same, "
        "on random inputs at the check sizes. The fastest checked schedule is in bold; its last step is in "
        "trace.json (open in ui.perfetto.dev). The baselines' eager dropout draws torch's random mask, the "
        "schedules cocoweave's counter-based one (the same work). The model- and pipeline-parallel workloads run "
        "in fp16 on GPUs, as in CoCoNet, and in fp32 on CPUs, where fp16 matmuls are emulated.", "",
        "![step time per schedule](bars.png)", "",
    ]
    for w in result.workloads:
        sizes = ", ".join(f"{k}={v}" for k, v in w.sizes.items())
        check = ", ".join(f"{k}={v}" for k, v in w.check_sizes.items())
        lines += [f"## {w.key}: {w.title}", "",
                  f"{w.dtype}, timed at {sizes}; checked at {check}. Baseline: {w.baseline}.", ""]
        best = w.fastest
        if best is not None:
            lines += [f"Fastest: `{best.schedule}`, {_ms(best.ms)} ms, {_speedup(best.speedup)} the baseline.", ""]
        lines += _markdown_table(w)
    return "\n".join(lines)


def bar_chart(result: DemoResult, path: Path) -> None:
    """bars.png: one panel per workload, a bar per schedule (ms) and the baseline's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [w for w in result.workloads if not w.skipped]
    heights = [len(w.rows) + 1 for w in shown] or [1]
    fig, axes = plt.subplots(len(shown) or 1, 1, figsize=(9, 1.2 + 0.24 * sum(heights) + 0.8 * len(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, w in zip(axes[:, 0], shown):
        labels = [f"baseline ({w.baseline})"] + [r.schedule for r in w.rows]
        values = [w.baseline_ms] + [r.ms if math.isfinite(r.ms) else 0.0 for r in w.rows]
        best = w.fastest
        colors = ["#999999"] + ["#2ca02c" if r is best else ("#d62728" if not r.checked else "#1f77b4")
                                for r in w.rows]
        y = range(len(labels))
        ax.barh(y, values, color=colors)
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title(w), fontsize=9, loc="left")
        ax.set_xlabel("ms per step (median, slowest rank)", fontsize=8)
        for i, (v, r) in enumerate(zip(values[1:], w.rows), start=1):
            if math.isfinite(r.speedup):
                ax.text(v, i, f" {r.speedup:.2f}x", va="center", fontsize=6)
    fig.suptitle(f"cocoweave demo: {result.world_size} ranks, {result.backend} on {result.device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
            "iters": result.iters, "warmup": result.warmup, "quick": result.quick, "start_s": result.start_s,
            "total_s": result.total_s, "workloads": [asdict(w) for w in result.workloads]}
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    bar_chart(result, out / "bars.png")
    merge_and_write(result.events, out / "trace.json")
    return out
