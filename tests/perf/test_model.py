"""The cost model applies the learned correction only where it measured better than the analytic model on
held-out store rows, and says why in a sentence either way."""

from __future__ import annotations

import numpy as np
import pandas as pd

from cocoweave.perf.costmodel import FEATURES
from cocoweave.perf.model import checked_correction


def rows(n: int, measured_over_analytic, seed: int = 0) -> pd.DataFrame:
    """Synthetic training rows: measured = analytic x f(communication share), one configuration each."""
    rng = np.random.default_rng(seed)
    comm, kernel = rng.uniform(0.1, 50, n), rng.uniform(0.1, 50, n)
    frame = pd.DataFrame({f: rng.uniform(0, 4, n) for f in FEATURES})
    frame["comm_ms"], frame["kernel_ms"], frame["analytic_ms"] = comm, kernel, comm + kernel
    frame["measured_ms"] = frame["analytic_ms"] * measured_over_analytic(comm / (comm + kernel), rng)
    frame["label"], frame["group"] = [f"s{i}" for i in range(n)], [f"g{i}" for i in range(n)]
    return frame


def test_a_correction_that_helps_on_held_out_rows_is_applied():
    corr, note = checked_correction(rows(60, lambda share, rng: 1.0 + 2.0 * share))
    assert corr is not None and note.startswith("applied: on held-out rows it measured")


def test_a_correction_that_does_not_help_is_left_out():
    # the analytic model is right on average; what remains is noise the features cannot explain
    corr, note = checked_correction(rows(60, lambda share, rng: rng.uniform(0.7, 1.3, share.size)))
    assert corr is None and note.startswith("not applied: on held-out rows it measured")


def test_too_few_rows_to_check_is_not_applied():
    corr, note = checked_correction(rows(5, lambda share, rng: 2.0 + 0 * share))
    assert corr is None and "too few to check it on held-out rows" in note
