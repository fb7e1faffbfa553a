"""The learned correction: trained on store rows that carry analytic predictions, it removes a
systematic error of the analytic model; the accuracy report holds out whole configurations."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cocoweave.cluster.cmdare.regression import mape
from cocoweave.errors import CocoweaveError
from cocoweave.ir.loader import load_example
from cocoweave.perf.correction import Correction, accuracy, scatter_png, training_rows
from cocoweave.perf.costmodel import FEATURES
from cocoweave.perf.measure import Measurement, records
from cocoweave.perf.store import MeasurementStore
from cocoweave.schedule.enumerate import enumerate_schedules


def _rows(n: int, factor, seed: int = 0) -> pd.DataFrame:
    """Synthetic rows whose measured time is the analytic one times factor(comm share)."""
    rng = np.random.default_rng(seed)
    comm, kernel = rng.uniform(0.1, 50, n), rng.uniform(0.1, 50, n)
    frame = pd.DataFrame({f: rng.uniform(0, 4, n) for f in FEATURES})
    frame["comm_ms"], frame["kernel_ms"], frame["analytic_ms"] = comm, kernel, comm + kernel
    frame["measured_ms"] = frame["analytic_ms"] * factor(comm / (comm + kernel))
    frame["label"], frame["group"] = [f"s{i}" for i in range(n)], [f"g{i}" for i in range(n)]
    return frame


def test_correction_learns_a_known_systematic_error():
    truth = lambda share: 1.0 + 2.0 * share  # noqa: E731 - communication is 3x slower than calibrated
    train, test = _rows(80, truth, 0), _rows(30, truth, 1)
    corr = Correction.fit(train)
    corrected = corr.factor(test[list(FEATURES)].to_dict("records")) * test["analytic_ms"]
    assert mape(test["measured_ms"], corrected) < 5.0 < mape(test["measured_ms"], test["analytic_ms"])


def test_the_correction_stays_within_the_trained_ratios_and_too_few_rows_are_refused():
    corr = Correction.fit(_rows(10, lambda s: 1.5 + 0 * s))
    far = dict.fromkeys(FEATURES, 1e6)  # far outside anything seen in training
    assert corr.factor([far])[0] == pytest.approx(1.5, rel=1e-6)
    with pytest.raises(CocoweaveError, match="at least 6 measured rows"):
        Correction.fit(_rows(3, lambda s: 1.0 + 0 * s))


def test_accuracy_report_and_scatter_png(tmp_path):
    report = accuracy(_rows(40, lambda s: 2.0 + 0 * s), test_fraction=0.25)
    assert report.n_test == 10 and report.n_train == 30
    assert report.corrected_mape < 1.0 and report.analytic_mape == pytest.approx(50.0)
    assert scatter_png(report, tmp_path / "acc.png", "t").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(CocoweaveError, match="accuracy report needs"):
        accuracy(_rows(5, lambda s: 1.0 + 0 * s))


def test_measurement_records_round_trip_through_the_store_into_training_rows(tmp_path):
    program = load_example("adam.py:adam", N=64)
    schedules = enumerate_schedules(program)[:2]
    ms = [Measurement(s, 2, 1.5 + i, [1.5 + i, 1.6 + i], {"0:AR": 0.5}) for i, s in enumerate(schedules)]

    class Pred:
        total_ms, features = 1.0, dict.fromkeys(FEATURES, 1.0)

    store = MeasurementStore(tmp_path / "store")
    store.append(records(program, {}, ms, backend="torch", device="cpu", source="test",
                         predictions={schedules[0].name: Pred()}))
    df = store.load()
    assert list(df["schedule"]) == [s.name for s in schedules] and list(df["total_ms"]) == [1.5, 2.5]
    assert df["git_commit"].notna().all() and (df["world_size"] == 2).all()
    rows = training_rows(df, "torch", "cpu")
    assert len(rows) == 1 and rows["measured_ms"].iloc[0] == 1.5  # only the row with a prediction
    assert training_rows(df, "torch", "cuda").empty
