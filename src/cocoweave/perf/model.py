"""The cost model the tuner and `perf predict` use: the analytic model under a calibration, times the
learned correction where the store holds enough measurements to train one and, on held-out rows, it
measured better than the analytic model alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import CocoweaveError
from ..plan import lower
from ..schedule.schedule import Schedule
from .correction import MIN_ROWS, Correction, accuracy, training_rows
from .costmodel import Calibration, Prediction, load_calibration, predict_plan
from .store import MeasurementStore


@dataclass
class Predicted:
    """One schedule's prediction: analytic, and corrected (equal to analytic without a correction)."""

    schedule: Schedule
    analytic: Prediction
    corrected_ms: float

    @property
    def ms(self) -> float:
        return self.corrected_ms


def checked_correction(rows) -> tuple[Correction | None, str]:
    """The learned correction trained on `rows`, but only if it measured better than the analytic model on
    held-out rows of them (`correction.accuracy`); None otherwise. Also a sentence saying which and why."""
    groups = rows["group"].nunique() if len(rows) else 0
    if len(rows) < MIN_ROWS + 2 or groups < 4:
        return None, (f"not applied: {len(rows)} measured rows with predictions over {groups} configurations are "
                      f"too few to check it on held-out rows (it needs {MIN_ROWS + 2} over 4)")
    try:
        report = accuracy(rows)
        if report.corrected_mape >= report.analytic_mape:
            return None, (f"not applied: on held-out rows it measured {report.corrected_mape:.1f}% MAPE, the "
                          f"analytic model {report.analytic_mape:.1f}%")
        return Correction.fit(rows), (f"applied: on held-out rows it measured {report.corrected_mape:.1f}% MAPE "
                                      f"against the analytic model's {report.analytic_mape:.1f}%")
    except CocoweaveError as exc:
        return None, f"not applied: {exc}"


class CostModel:
    """Analytic prediction from a calibration, optionally corrected by a model trained on the store."""

    def __init__(self, calibration: Calibration, correction: Correction | None = None,
                 correction_note: str = "") -> None:
        self.calibration = calibration
        self.correction = correction
        self.correction_note = correction_note or ("applied" if correction is not None else "none")

    @classmethod
    def load(cls, backend: str, device: str, world_size: int, store: MeasurementStore | None = None,
             correct: bool = True, fitted: tuple[Correction | None, str] | None = None) -> CostModel | None:
        """The model for (backend, device, world size): None if that was never calibrated. The correction is
        trained on the store's rows of that backend and device, and used only where it measured better than
        the analytic model on held-out rows (`checked_correction`); `fitted` is one trained already, e.g. by
        the model of another world size (the rows do not depend on it), as (correction, note)."""
        cal = load_calibration(backend, device, world_size)
        if cal is None:
            return None
        if not correct or store is None:
            return cls(cal, None, "not requested" if not correct else "no measurement store")
        correction, note = fitted or checked_correction(training_rows(store.load(), backend, device))
        return cls(cal, correction, note)

    def predict(self, schedule: Schedule, sizes: Mapping[str, int], world_size: int) -> Predicted:
        """Predicted step time of `schedule` on `world_size` ranks."""
        analytic = predict_plan(lower(schedule), sizes, world_size, self.calibration)
        corrected = analytic.total_ms if self.correction is None else self.correction.predict(analytic.features)
        return Predicted(schedule, analytic, corrected)
