"""How long a checkpoint takes (CM-DARE's duration-vs-size data) and how often to take one (Young)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from sklearn.model_selection import GroupKFold

from cocoweave.cluster.cmdare.features import checkpoint_features
from cocoweave.cluster.cmdare.regression import CV_FOLDS, Selection, log_space_candidates, select
from cocoweave.cluster.cmdare.tables import canonical_model, load_checkpoint_sizes, load_checkpoints
from cocoweave.errors import PlanningError


@dataclass
class CheckpointModel:
    """Checkpoint duration as a function of size, and the measured checkpoint size of each known model."""

    selection: Selection
    sizes_mb: dict[str, float]
    min_size_mb: float = 0.0  # the smallest checkpoint measured: smaller ones are priced at this size

    def duration_s(self, size_mb: float) -> float:
        """Predicted seconds to write a checkpoint of `size_mb` megabytes (no extrapolation below the smallest
        measured size: the fixed cost of a write dominates there)."""
        size = max(size_mb, self.min_size_mb)
        return float(self.selection.predict(checkpoint_features(pd.DataFrame({"size_mb": [size]})))[0])

    def size_mb(self, model: str) -> float:
        """Measured checkpoint size of a CM-DARE model."""
        slug = canonical_model(model)
        if slug not in self.sizes_mb:
            raise PlanningError(f"no checkpoint size measured for model {model!r}; "
                                f"known: {', '.join(sorted(self.sizes_mb))}.")
        return self.sizes_mb[slug]


def fit_checkpoint_model(data_dir: Path) -> CheckpointModel:
    """Select and fit the checkpoint-duration model on all checkpoints, CV folds grouped by model."""
    whole = load_checkpoints(data_dir)["whole"]
    selection = select(log_space_candidates(), checkpoint_features(whole), whole["duration_s"],
                       GroupKFold(CV_FOLDS), groups=whole["model"])
    sizes = load_checkpoint_sizes(data_dir)
    return CheckpointModel(selection, dict(zip(sizes["model"], sizes["size_mb"])), float(whole["size_mb"].min()))


def young_interval(checkpoint_time: float, mtbf: float) -> float:
    """Young's optimal time between checkpoints, sqrt(2 x checkpoint time x mean time between failures),
    in the unit of its arguments."""
    if checkpoint_time <= 0 or mtbf <= 0:
        raise ValueError("checkpoint time and mean time between failures must be positive")
    return math.sqrt(2.0 * checkpoint_time * mtbf)
