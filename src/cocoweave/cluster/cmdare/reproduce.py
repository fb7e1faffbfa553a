"""Reproduce CM-DARE's prediction results with the paper's protocols, our models beside its baselines.

Protocols: (a) per GPU, random 80/20 split; (b) one GPU-agnostic model, random 80/20 split;
(c) four models held out of training; (d) checkpoint duration from checkpoint size. Random splits
are drawn as in the paper's notebooks (Sigmetrics2020_*.ipynb in cake-lab/CM-DARE), so seed 0 is
the paper's own split, and the baselines use the paper's features. Every model is tuned by
cross-validation on the training part only; folds are random for random-split protocols and
grouped by model for held-out ones, mirroring how the test differs from the training part.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from joblib import Parallel, delayed
from sklearn.model_selection import GroupKFold, KFold, train_test_split
from sklearn.utils import shuffle

from cocoweave.cluster.cmdare import tables as data
from cocoweave.cluster.cmdare.features import (
    checkpoint_features,
    paper_checkpoint_features,
    paper_speed_features,
    speed_features,
)
from cocoweave.cluster.cmdare.ps_scaling import ScalingReport, scaling_report
from cocoweave.cluster.cmdare.regression import (
    CV_FOLDS,
    Candidate,
    checkpoint_svr_baseline,
    linear_baseline,
    log_space_candidates,
    mape,
    select,
    svr_baseline,
)

# Published MAPE (%) from the paper's notebooks, keyed by (protocol, scope) then method.
PUBLISHED: dict[tuple[str, str], dict[str, float]] = {
    ("a", "K80"): {"SVR (paper)": 9.96, "linear (paper)": 19.06},
    ("a", "P100"): {"SVR (paper)": 13.79, "linear (paper)": 22.28},
    ("b", "K80+P100"): {"linear (paper)": 38.24},
    ("d", "random split"): {"SVR (paper)": 5.38},
}
PROTOCOLS = {
    "a": "per-GPU step time, random 80/20",
    "b": "GPU-agnostic step time, random 80/20",
    "c": "per-GPU step time, held-out models",
    "d": "checkpoint time vs size",
}
TEST_FRACTION = 0.2
OURS = "ours"
PER_MODEL_MEAN = "per-model mean"
# The order results are shown in: held-out models first (what a new model faces), then random splits.
PROTOCOL_ORDER = ("c", "d", "a", "b")


@dataclass
class ProtocolResult:
    """MAPE of one method under one protocol and scope, one value per split seed."""

    protocol: str
    scope: str
    method: str
    mapes: list[float] = field(default_factory=list)
    choices: list[str] = field(default_factory=list)
    published: float | None = None

    @property
    def mean(self) -> float:
        return float(np.mean(self.mapes))

    @property
    def held_out(self) -> bool:
        """Whether the test models were never seen in training (protocol (c), and (d) split by model)."""
        return self.protocol == "c" or self.scope == "held-out models"

    @property
    def seed0(self) -> float:
        return self.mapes[0]

    @property
    def choice(self) -> str:
        """The chosen candidate, with how many splits chose it when they disagree."""
        counts = Counter(self.choices).most_common()
        if len(counts) == 1:
            return counts[0][0]
        return ", ".join(f"{name} x{n}" for name, n in counts)


@dataclass
class CmdareReport:
    """Everything `cocoweave perf cmdare` prints: MAPE per protocol and the PS-bottleneck analysis."""

    results: list[ProtocolResult]
    scaling: ScalingReport
    startup: pd.DataFrame
    seeds: list[int]

    def to_json(self) -> dict:
        rows = []
        for r in self.results:
            row = asdict(r)
            row.update(mean=r.mean, seed0=r.seed0, protocol_name=PROTOCOLS[r.protocol], held_out=r.held_out)
            rows.append(row)
        return {"seeds": self.seeds, "mape": rows, "scaling": self.scaling.to_json(),
                "startup": self.startup.to_dict(orient="records")}


FeatureFn = Callable[[pd.DataFrame], pd.DataFrame]


@dataclass
class Split:
    """One train/test split of one protocol, with the CV splitter used for selection on `train`."""

    protocol: str
    scope: str
    train: pd.DataFrame
    test: pd.DataFrame
    ours: FeatureFn
    paper: FeatureFn
    target: str
    cv: object
    grouped: bool
    svr: Candidate


def random_splits(frame: pd.DataFrame, protocol: str, scope: str, ours: FeatureFn, paper: FeatureFn,
                  target: str, seeds: Sequence[int], pre_shuffle: bool, svr: Candidate) -> list[Split]:
    """Random 80/20 splits, one per seed, made as the paper's notebooks made them (shuffle(seed) first
    where they did), so seed 0 is the paper's split; CV folds come from the training part."""
    out = []
    for seed in seeds:
        rows = shuffle(frame, random_state=seed) if pre_shuffle else frame
        train, test = train_test_split(rows, test_size=TEST_FRACTION, random_state=seed)
        out.append(Split(protocol, scope, train, test, ours, paper, target,
                         KFold(CV_FOLDS, shuffle=True, random_state=seed), False, svr))
    return out


def heldout_split(train: pd.DataFrame, test: pd.DataFrame, protocol: str, scope: str, ours: FeatureFn,
                  paper: FeatureFn, target: str, svr: Candidate) -> Split:
    """Train on some models, test on others; CV folds group rows by model, so that selection faces the
    same shift as the test."""
    cv = GroupKFold(min(CV_FOLDS, train["model"].nunique()))
    return Split(protocol, scope, train, test, ours, paper, target, cv, True, svr)


def _per_gpu_paper(df: pd.DataFrame) -> pd.DataFrame:
    return paper_speed_features(df, agnostic=False)


def _agnostic_paper(df: pd.DataFrame) -> pd.DataFrame:
    return paper_speed_features(df, agnostic=True)


def speed_splits(speed: pd.DataFrame, heldout_k80: pd.DataFrame, seeds: Sequence[int]) -> list[Split]:
    """Protocols (a), (b) and (c) on single-worker step time."""
    target, svr = "step_time_s", svr_baseline()
    gpus = sorted(speed["gpu"].unique())
    out: list[Split] = []
    for gpu in gpus:
        rows = speed[speed["gpu"] == gpu]
        out += random_splits(rows, "a", gpu, speed_features, _per_gpu_paper, target, seeds, True, svr)
    out += random_splits(speed, "b", "K80+P100", speed_features, _agnostic_paper, target, seeds, True, svr)
    for gpu in gpus:
        rows = speed[speed["gpu"] == gpu]
        train = rows[~rows["model"].isin(data.HELD_OUT_MODELS)]
        # The paper's K80 test file holds more samples of the held-out models than the main table.
        test = heldout_k80 if gpu == "K80" else rows[rows["model"].isin(data.HELD_OUT_MODELS)]
        out.append(heldout_split(train, test, "c", gpu, speed_features, _per_gpu_paper, target, svr))
    return out


def checkpoint_splits(ckpt: dict[str, pd.DataFrame], seeds: Sequence[int]) -> list[Split]:
    """Protocol (d): random 80/20 splits of all checkpoints (the paper's), and the paper's split by model."""
    target, svr = "duration_s", checkpoint_svr_baseline()
    out = random_splits(ckpt["whole"], "d", "random split", checkpoint_features, paper_checkpoint_features,
                        target, seeds, False, svr)
    out.append(heldout_split(ckpt["train"], ckpt["test"], "d", "held-out models", checkpoint_features,
                             paper_checkpoint_features, target, svr))
    return out


def per_model_mean(train: pd.DataFrame, test: pd.DataFrame, target: str) -> np.ndarray:
    """Predict each test row by the mean of the training rows of the same model (and GPU, where the table has
    one): the noise floor of a random split, which puts repeats of every model on both sides. A model with
    no training row falls back to the mean of all training rows (of its GPU)."""
    keys = ["model", "gpu"] if "gpu" in train.columns else ["model"]
    means = train.groupby(keys)[target].mean()
    pred = pd.Series([means.get(tuple(k) if len(keys) > 1 else k[0], np.nan)
                      for k in test[keys].itertuples(index=False)], index=test.index, dtype=float)
    fallback = (test["gpu"].map(train.groupby("gpu")[target].mean()) if "gpu" in keys
                else pd.Series(train[target].mean(), index=test.index))
    return pred.fillna(fallback).to_numpy()


def compare(split: Split, candidates: Sequence[Candidate]) -> dict[str, tuple[float, str]]:
    """Fit the two baselines and our selection on the split's training part; MAPE of each on its test part.
    Random splits also get the per-model-mean baseline (held-out models have no training rows to average)."""
    groups = split.train["model"] if split.grouped else None
    out = {}
    if not split.grouped:
        out[PER_MODEL_MEAN] = (mape(split.test[split.target],
                                    per_model_mean(split.train, split.test, split.target)), "mean of repeats")
    for method, feats, cands in (("linear (paper)", split.paper, [linear_baseline()]),
                                 ("SVR (paper)", split.paper, [split.svr]),
                                 (OURS, split.ours, candidates)):
        sel = select(cands, feats(split.train), split.train[split.target], split.cv, groups)
        out[method] = (mape(split.test[split.target], sel.predict(feats(split.test))), sel.name)
    return out


def evaluate_splits(splits: Sequence[Split], candidates: Sequence[Candidate],
                    n_jobs: int = 1) -> list[ProtocolResult]:
    """Run `compare` on every split (in parallel processes if n_jobs != 1) and gather MAPE per method,
    held-out protocols first."""
    scores = Parallel(n_jobs=n_jobs)(delayed(compare)(split, candidates) for split in splits)
    results: dict[tuple[str, str, str], ProtocolResult] = {}
    for split, per_method in zip(splits, scores):
        for method, (value, choice) in per_method.items():
            key = (split.protocol, split.scope, method)
            res = results.setdefault(key, ProtocolResult(
                split.protocol, split.scope, method,
                published=PUBLISHED.get((split.protocol, split.scope), {}).get(method)))
            res.mapes.append(value)
            res.choices.append(choice)
    return sorted(results.values(), key=lambda r: (not r.held_out, PROTOCOL_ORDER.index(r.protocol)))


def reproduce(data_dir: Path, seeds: Sequence[int] = range(5), candidates: Sequence[Candidate] | None = None,
              n_jobs: int = 1) -> CmdareReport:
    """Run every protocol and the parameter-server analysis on the CM-DARE tables in `data_dir`."""
    cands = list(candidates) if candidates is not None else log_space_candidates()
    seeds = list(seeds)
    speed = data.load_speed(data_dir)
    splits = speed_splits(speed, data.load_heldout_k80(data_dir), seeds)
    splits += checkpoint_splits(data.load_checkpoints(data_dir), seeds)
    results = evaluate_splits(splits, cands, n_jobs)
    scaling = scaling_report(data.load_cluster_throughput(data_dir), speed)
    startup = (data.load_startup(data_dir).groupby(["gpu", "pricing"])["startup_s"]
               .agg(["mean", "std", "count"]).reset_index())
    return CmdareReport(results, scaling, startup, seeds)
