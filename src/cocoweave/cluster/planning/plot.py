"""Draw a plan as a PNG: every configuration by time and cost, the Pareto front, the constraints and
the recommendation."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from cocoweave.cluster.planning.planner import ClusterPlan
from cocoweave.figures import figure

MARKERS = {"on-demand": "o", "spot": "^"}


def write_plan_png(plan: ClusterPlan, path: str | os.PathLike, title: str) -> Path:
    """Write the time/cost scatter of `plan` to `path` and return the path."""
    path = Path(path)
    fig = figure(figsize=(8, 5.5))
    ax = fig.subplots()
    ax.set_xscale("log")
    ax.set_yscale("log")
    gpus = sorted({o.machine.gpu for o in plan.options})
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {gpu: cycle[i % len(cycle)] for i, gpu in enumerate(gpus)}  # more GPU types than colours: reused
    for gpu in gpus:
        for pricing, marker in MARKERS.items():
            pts = [o for o in plan.options if o.machine.gpu == gpu and o.pricing == pricing]
            if pts:
                ax.scatter([o.hours for o in pts], [o.cost for o in pts], s=18, alpha=0.45, marker=marker,
                           color=colors[gpu], label=f"{gpu} {pricing}")
    ax.step([o.hours for o in plan.front], [o.cost for o in plan.front], where="post", color="black",
            linewidth=1.2, label="Pareto front")
    ax.scatter([plan.best.hours], [plan.best.cost], s=220, marker="*", color="crimson", zorder=5,
               label=f"recommended: {plan.best.describe()}")
    if plan.deadline_h is not None:
        ax.axvline(plan.deadline_h, linestyle="--", color="gray", label=f"deadline {plan.deadline_h:g} h")
    if plan.budget_usd is not None:
        ax.axhline(plan.budget_usd, linestyle=":", color="gray", label=f"budget ${plan.budget_usd:,.0f}")
    for axis, unit in ((ax.xaxis, ""), (ax.yaxis, "$")):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _, unit=unit: f"{unit}{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("expected time (hours)")
    ax.set_ylabel("expected cost (dollars)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="best")
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
