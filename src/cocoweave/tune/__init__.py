"""The autotuner: predict every schedule, measure the best few and the baseline, cache the fastest."""

from .cache import TuneCache, auto_schedule, cache_key, cached_schedule
from .tuner import Candidate, TuneResult, tune

__all__ = ["Candidate", "TuneCache", "TuneResult", "auto_schedule", "cache_key", "cached_schedule", "tune"]
