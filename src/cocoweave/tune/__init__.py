"""The autotuner: predict every schedule, measure the best few and the baseline, cache the fastest.

The cache (`cached_schedule`, what `schedule="auto"` and the optimizers consult) imports no measurement machinery;
the tuner itself (`tune`, which measures and reads the Parquet store: pandas, pyarrow) loads on first use, so that
looking up a cached choice does not cost a training process ~70 MiB of modules it never runs.
"""

from typing import Any

from .cache import TuneCache, auto_schedule, cache_key, cached_schedule

__all__ = ["Candidate", "TuneCache", "TuneResult", "auto_schedule", "cache_key", "cached_schedule", "tune"]
_TUNER = ("Candidate", "TuneResult", "tune")


def __getattr__(name: str) -> Any:
    if name in _TUNER:
        from . import tuner

        return getattr(tuner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
