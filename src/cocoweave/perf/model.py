"""The cost model the tuner and `perf predict` use: the analytic model under a calibration, times the
learned correction when the store holds enough measurements to train one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import CocoweaveError
from ..plan import lower
from ..schedule.schedule import Schedule
from .correction import MIN_ROWS, Correction, training_rows
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


class CostModel:
    """Analytic prediction from a calibration, optionally corrected by a model trained on the store."""

    def __init__(self, calibration: Calibration, correction: Correction | None = None) -> None:
        self.calibration = calibration
        self.correction = correction

    @classmethod
    def load(cls, backend: str, device: str, world_size: int, store: MeasurementStore | None = None,
             correct: bool = True) -> CostModel | None:
        """The model for (backend, device, world size): None if that was never calibrated. The correction
        is trained on the store's rows of that backend and device when there are enough of them."""
        cal = load_calibration(backend, device, world_size)
        if cal is None:
            return None
        correction = None
        if correct and store is not None:
            rows = training_rows(store.load(), backend, device)
            if len(rows) >= MIN_ROWS:
                try:
                    correction = Correction.fit(rows)
                except CocoweaveError:
                    correction = None
        return cls(cal, correction)

    def predict(self, schedule: Schedule, sizes: Mapping[str, int], world_size: int) -> Predicted:
        """Predicted step time of `schedule` on `world_size` ranks."""
        analytic = predict_plan(lower(schedule), sizes, world_size, self.calibration)
        corrected = analytic.total_ms if self.correction is None else self.correction.predict(analytic.features)
        return Predicted(schedule, analytic, corrected)
