"""Model fitting and selection on synthetic data with a known answer."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.model_selection import KFold

from cocoweave.cluster.cmdare.regression import (
    RelativeLinear,
    linear_baseline,
    log_space_candidates,
    mape,
    select,
)


def linear_law(n: int, seed: int) -> tuple[pd.DataFrame, pd.Series]:
    """Step time = 0.02 s + 3 ns x FLOPs + 0.5 us x tensors: an additive cost law, no noise."""
    rng = np.random.default_rng(seed)
    flops = rng.uniform(1e7, 2e8, n)
    tensors = rng.integers(50, 300, n).astype(float)
    y = 0.02 + 3e-9 * flops + 5e-7 * tensors
    return pd.DataFrame({"log_flops": np.log(flops), "log_tensors": np.log(tensors)}), pd.Series(y)


def test_mape_is_a_percentage():
    assert mape([1.0, 2.0], [1.1, 1.8]) == pytest.approx(10.0)


def test_relative_linear_recovers_a_linear_law_exactly():
    X, y = linear_law(200, 0)
    model = RelativeLinear().fit(np.exp(X), y)
    assert model.model_.intercept_ == pytest.approx(0.02, rel=1e-6)
    assert model.model_.coef_ == pytest.approx([3e-9, 5e-7], rel=1e-6)


def test_selection_finds_the_true_law_and_predicts_unseen_points_with_zero_error():
    X, y = linear_law(160, 1)
    sel = select(log_space_candidates(), X, y, KFold(5, shuffle=True, random_state=0))
    assert sel.name == "additive law"
    assert sel.name == min(sel.cv_table, key=sel.cv_table.get)  # the winner is the CV winner
    assert set(sel.cv_table) == {c.name for c in log_space_candidates()}
    X_new, y_new = linear_law(50, 2)
    assert mape(y_new, sel.predict(X_new)) < 1e-4


def test_selection_depends_on_training_data_only():
    X, y = linear_law(120, 3)
    cv = KFold(5, shuffle=True, random_state=0)
    first = select([linear_baseline(), *log_space_candidates()[:2]], X, y, cv)
    again = select([linear_baseline(), *log_space_candidates()[:2]], X, y, cv)
    assert first.name == again.name and first.cv_mape == again.cv_mape
