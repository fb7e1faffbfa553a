"""Draw a profiled script's scaling as a PNG (`cocoweave profile --png`): the step time measured on every world,
those the model was fitted on apart from those that check it, and the model's prediction at every size."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from cocoweave.cluster.profiling.run_profile import RunProfile
from cocoweave.figures import figure


def write_profile_png(profile: RunProfile, sizes: Sequence[int], path: str | os.PathLike, title: str) -> Path:
    """Write the measured and predicted ms per step against the ranks (the measured worlds and `sizes`)."""
    path = Path(path)
    worlds = sorted({r.world_size for r in profile.runs} | set(sizes))
    predicted = profile.predict(worlds)
    fig = figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ax.plot(worlds, [p.predicted_ms for p in predicted], "-", color="C0", linewidth=1.5,
            label="predicted (fitted on " + ", ".join(map(str, profile.fit_world_sizes)) + " ranks)")
    for role, marker, color, runs in (
            ("measured, fitted", "o", "C1", [r for r in profile.runs if r.world_size in profile.fit_world_sizes]),
            ("measured, checked", "s", "C2", [r for r in profile.runs if r.world_size not in profile.fit_world_sizes])):
        if runs:
            ax.scatter([r.world_size for r in runs], [r.step_ms for r in runs], s=40, marker=marker, color=color,
                       zorder=3, label=role)
    ax.set_xticks(worlds if len(worlds) <= 16 else worlds[::max(1, len(worlds) // 16)])
    ax.set(xlabel="ranks", ylabel="ms per step (median)", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
