"""Measurement and cost model: the measurement store, calibration, the analytic cost model, its learned
correction and the timing of schedules. Cluster planning lives in `cocoweave.cluster`."""
