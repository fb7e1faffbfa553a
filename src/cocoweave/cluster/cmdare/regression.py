"""Candidate regressors and model selection by cross-validated MAPE on the training part only.

Our candidates predict in log space (errors are relative, step times span 35x) or fit a
non-negative additive cost law by relative least squares; the test set never influences a choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.compose import TransformedTargetRegressor
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import LinearRegression, Ridge
from sklearn.metrics import mean_absolute_percentage_error
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import FunctionTransformer, PolynomialFeatures, StandardScaler
from sklearn.svm import SVR
from threadpoolctl import threadpool_limits

SCORING = "neg_mean_absolute_percentage_error"
CV_FOLDS = 5  # cross-validation folds of every model selection


def mape(y_true: Sequence[float], y_pred: Sequence[float]) -> float:
    """Mean absolute percentage error in percent (scikit-learn's, times 100): the measured values first."""
    return float(100.0 * mean_absolute_percentage_error(y_true, y_pred))


class RelativeLinear(RegressorMixin, BaseEstimator):
    """Non-negative linear law fitted by least squares on relative error (the quantity MAPE measures)."""

    def fit(self, X, y):  # noqa: N803 (sklearn's argument names)
        y = np.asarray(y, dtype=float)
        self.model_ = LinearRegression(positive=True).fit(X, y, sample_weight=1.0 / np.square(y))
        return self

    def predict(self, X):  # noqa: N803
        return self.model_.predict(X)


@dataclass(frozen=True)
class Candidate:
    """A named estimator factory and the hyper-parameter grid searched by cross-validation."""

    name: str
    build: Callable[[], BaseEstimator]
    grid: dict[str, list] = field(default_factory=dict)


def _log_target(pipeline: Pipeline) -> TransformedTargetRegressor:
    return TransformedTargetRegressor(regressor=pipeline, func=np.log, inverse_func=np.exp)


def log_space_candidates() -> list[Candidate]:
    """Our candidates for log-scale features (log FLOPs/TFLOPS, log bytes/bandwidth, ...): ridge on the
    logs (a power law) and on their squares, RBF SVR, RBF kernel ridge (KRR), gradient boosting (GBM),
    all with a log target, and a non-negative additive law on the exponentiated features."""
    return [
        Candidate("log ridge", lambda: _log_target(make_pipeline(StandardScaler(), Ridge())),
                  {"regressor__ridge__alpha": [1e-3, 1.0]}),
        Candidate("log quad ridge", lambda: _log_target(make_pipeline(
            StandardScaler(), PolynomialFeatures(2), StandardScaler(), Ridge())),
                  {"regressor__ridge__alpha": [1e-3, 1.0]}),
        Candidate("log SVR", lambda: _log_target(make_pipeline(StandardScaler(), SVR())),
                  {"regressor__svr__C": [1.0, 10.0, 100.0], "regressor__svr__epsilon": [0.01, 0.05],
                   "regressor__svr__gamma": ["scale", 10.0]}),
        Candidate("log KRR", lambda: _log_target(make_pipeline(
            StandardScaler(), KernelRidge(kernel="rbf"))),
                  {"regressor__kernelridge__alpha": [1e-3, 1e-2],
                   "regressor__kernelridge__gamma": [0.1, 1.0]}),
        Candidate("log GBM", lambda: _log_target(make_pipeline(GradientBoostingRegressor(
            n_estimators=100, learning_rate=0.1, random_state=0))),
                  {"regressor__gradientboostingregressor__max_depth": [2, 3]}),
        Candidate("additive law", lambda: make_pipeline(FunctionTransformer(np.exp), RelativeLinear())),
    ]


def linear_baseline() -> Candidate:
    """The paper's linear regression on raw features."""
    return Candidate("linear (paper)", LinearRegression)


def svr_baseline() -> Candidate:
    """The paper's RBF SVR on its standardised feature; C and epsilon tuned by the same CV as ours
    (the notebooks tuned them by grid search, but do not show the values for step time)."""
    return Candidate("SVR (paper)", lambda: make_pipeline(StandardScaler(), SVR()),
                     {"svr__C": [1.0, 10.0, 100.0], "svr__epsilon": [0.001, 0.01]})


def checkpoint_svr_baseline() -> Candidate:
    """The paper's checkpoint SVR with the hyper-parameters of its notebook (C=10, gamma='auto',
    epsilon=0.14, raw size in MB)."""
    return Candidate("SVR (paper)", lambda: SVR(kernel="rbf", C=10.0, gamma="auto", epsilon=0.14))


@dataclass
class Selection:
    """The candidate that won cross-validation, refitted on the whole training part."""

    name: str
    params: dict
    cv_mape: float
    estimator: BaseEstimator
    cv_table: dict[str, float]

    def predict(self, X: pd.DataFrame) -> np.ndarray:  # noqa: N803
        return np.asarray(self.estimator.predict(X), dtype=float)


def select(candidates: Sequence[Candidate], X: pd.DataFrame, y: pd.Series, cv,  # noqa: N803
           groups: Sequence | None = None) -> Selection:
    """Grid-search every candidate with `cv` on (X, y) only and refit the one with the lowest CV MAPE.

    BLAS runs single-threaded: these matrices are tiny and threads only add contention."""
    with threadpool_limits(limits=1):
        return _select(candidates, X, y, cv, groups)


def _select(candidates: Sequence[Candidate], X: pd.DataFrame, y: pd.Series, cv,  # noqa: N803
            groups: Sequence | None) -> Selection:
    best: tuple[float, Candidate, GridSearchCV] | None = None
    table: dict[str, float] = {}
    for cand in candidates:
        search = GridSearchCV(cand.build(), {k: list(v) for k, v in cand.grid.items()} or [{}],
                              scoring=SCORING, cv=cv, refit=False, error_score="raise")
        search.fit(X, y, groups=groups)
        score = -100.0 * float(search.best_score_)
        table[cand.name] = score
        if best is None or score < best[0]:
            best = (score, cand, search)
    if best is None:
        raise ValueError("select() needs at least one candidate")
    score, cand, search = best
    estimator = cand.build().set_params(**search.best_params_).fit(X, y)
    return Selection(cand.name, dict(search.best_params_), score, estimator, table)

