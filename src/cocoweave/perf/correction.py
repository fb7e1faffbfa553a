"""The learned correction of the analytic cost model, trained on the measurement store.

A store row measured with a calibration carries the analytic prediction and its features in
`extra` (`predicted_ms`, `features`). The correction learns log(measured / analytic) from the
features (scikit-learn gradient boosting, shallow trees) and multiplies the analytic
prediction by its exponential. `accuracy` reports MAPE on held-out rows, grouped so that repeated
measurements of one configuration never sit on both sides of the split.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import CocoweaveError
from .costmodel import FEATURES

MIN_ROWS = 6


def training_rows(df: pd.DataFrame, backend: str | None = None, device: str | None = None) -> pd.DataFrame:
    """Store rows that carry an analytic prediction: FEATURES columns, `measured_ms`, `group`, `label`."""
    rows = []
    for r in df.itertuples(index=False):
        if (backend is not None and r.backend != backend) or (device is not None and r.device != device):
            continue
        extra = json.loads(r.extra) if isinstance(r.extra, str) else dict(r.extra)
        feats = extra.get("features")
        if not isinstance(feats, dict) or not extra.get("predicted_ms") or r.total_ms <= 0:
            continue
        row = {f: float(feats.get(f, 0.0)) for f in FEATURES}
        row |= {"measured_ms": float(r.total_ms), "label": f"{r.program}:{r.schedule}",
                "group": f"{r.schedule_fingerprint}|{r.sizes}|{r.world_size}|{r.device}"}
        rows.append(row)
    return pd.DataFrame(rows, columns=[*FEATURES, "measured_ms", "label", "group"])


def _matrix(rows: pd.DataFrame | Sequence[Mapping[str, float]]) -> np.ndarray:
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    return np.log1p(np.clip(frame[list(FEATURES)].to_numpy(dtype=float), 0.0, None))


@dataclass
class Correction:
    """A fitted multiplicative correction: corrected = analytic x exp(model(features))."""

    model: Any
    n_rows: int
    kind: str

    @classmethod
    def fit(cls, rows: pd.DataFrame, seed: int = 0) -> Correction:
        """Fit on training rows (from `training_rows`); CocoweaveError if there are too few."""
        if len(rows) < MIN_ROWS:
            raise CocoweaveError(f"the learned correction needs at least {MIN_ROWS} measured rows with "
                                 f"predictions in the store, found {len(rows)}; run `cocoweave tune` or "
                                 "`cocoweave measure` after `cocoweave perf calibrate`.")
        from sklearn.ensemble import GradientBoostingRegressor

        x = _matrix(rows)
        y = np.log(rows["measured_ms"].to_numpy() / np.maximum(rows["analytic_ms"].to_numpy(), 1e-9))
        # Trees never extrapolate past the ratios they were trained on: a few rows of one world size
        # cannot send another world size's predictions off by orders of magnitude (a linear model can).
        model = GradientBoostingRegressor(n_estimators=150, max_depth=2, learning_rate=0.05, subsample=0.8,
                                          min_samples_leaf=2, random_state=seed)
        kind = "gradient boosting"
        model.fit(x, y)
        return cls(model, len(rows), kind)

    def factor(self, features: Sequence[Mapping[str, float]]) -> np.ndarray:
        """The multiplicative correction for each feature dict."""
        return np.exp(np.clip(self.model.predict(_matrix(features)), -3.0, 3.0))

    def predict(self, features: Mapping[str, float]) -> float:
        """The corrected prediction (ms) for one analytic prediction's features."""
        return float(features["analytic_ms"] * self.factor([features])[0])


@dataclass
class AccuracyReport:
    """MAPE of the analytic model and of the corrected one on held-out store rows."""

    n_train: int
    n_test: int
    analytic_mape: float
    corrected_mape: float
    kind: str
    test: pd.DataFrame = field(repr=False)  # measured_ms, analytic_ms, corrected_ms, label


def accuracy(rows: pd.DataFrame, test_fraction: float = 0.25, seed: int = 0) -> AccuracyReport:
    """Hold out `test_fraction` of the measured configurations, fit the correction on the rest, report MAPE."""
    from sklearn.model_selection import GroupShuffleSplit

    from ..cluster.cmdare.regression import mape

    groups = rows["group"].nunique() if len(rows) else 0
    if groups < 4 or len(rows) < MIN_ROWS + 2:
        raise CocoweaveError(f"an accuracy report needs at least {MIN_ROWS + 2} measured rows over 4 "
                             f"configurations with predictions in the store, found {len(rows)} over {groups}.")
    split = GroupShuffleSplit(n_splits=1, test_size=test_fraction, random_state=seed)
    train_idx, test_idx = next(split.split(rows, groups=rows["group"]))
    train, test = rows.iloc[train_idx], rows.iloc[test_idx].copy()
    corr = Correction.fit(train, seed)
    test["corrected_ms"] = test["analytic_ms"].to_numpy() * corr.factor(test[list(FEATURES)].to_dict("records"))
    return AccuracyReport(len(train), len(test), mape(test["measured_ms"], test["analytic_ms"]),
                          mape(test["measured_ms"], test["corrected_ms"]), corr.kind,
                          test[["label", "measured_ms", "analytic_ms", "corrected_ms"]])


def scatter_png(report: AccuracyReport, path: Path, title: str) -> Path:
    """Predicted vs measured (log-log), analytic and corrected, with the y = x line."""
    from ..figures import figure

    t = report.test
    fig = figure(figsize=(5.5, 5))
    ax = fig.subplots()
    ax.scatter(t["measured_ms"], t["analytic_ms"], s=18, alpha=0.6,
               label=f"analytic (MAPE {report.analytic_mape:.1f}%)")
    ax.scatter(t["measured_ms"], t["corrected_ms"], s=18, marker="x",
               label=f"+ learned correction (MAPE {report.corrected_mape:.1f}%)")
    lo = min(t["measured_ms"].min(), t["analytic_ms"].min(), t["corrected_ms"].min()) * 0.8
    hi = max(t["measured_ms"].max(), t["analytic_ms"].max(), t["corrected_ms"].max()) * 1.25
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, ls="--")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (ms)",
           ylabel="predicted step time (ms)", title=title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
