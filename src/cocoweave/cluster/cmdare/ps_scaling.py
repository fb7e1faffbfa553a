"""Parameter-server bottleneck: measured cluster throughput vs linear scaling, and a fitted scaling law.

Efficiency(w) = throughput(w) / (w x throughput(1)). The bottleneck starts at the first worker count
whose efficiency falls below a threshold. The scaling law caps linear scaling by the parameter
servers' capacity: each global step costs the PS a fixed time per tensor plus its bytes over a
bandwidth; p servers raise the cap by p**gamma. A smooth minimum joins the two regimes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from cocoweave.cluster.cmdare.regression import mape
from cocoweave.cluster.cmdare.tables import BYTES_PER_PARAMETER

EFFICIENCY_THRESHOLD = 0.8
CONFIG_KEYS = ["gpu", "ps", "model"]


def efficiency_table(cluster: pd.DataFrame) -> pd.DataFrame:
    """Add single-worker throughput, predicted linear throughput and efficiency to each cluster run."""
    df = cluster.sort_values([*CONFIG_KEYS, "workers"]).copy()
    single = df[df["workers"] == 1].set_index(CONFIG_KEYS)["steps_per_s"].rename("single_steps_per_s")
    df = df.join(single, on=CONFIG_KEYS)
    df["linear_steps_per_s"] = df["workers"] * df["single_steps_per_s"]
    df["efficiency"] = df["steps_per_s"] / df["linear_steps_per_s"]
    return df.reset_index(drop=True)


def knee(workers: np.ndarray, efficiency: np.ndarray, threshold: float = EFFICIENCY_THRESHOLD) -> int | None:
    """The smallest worker count whose efficiency is below `threshold`; None if scaling holds throughout."""
    order = np.argsort(workers)
    for w, e in zip(np.asarray(workers)[order], np.asarray(efficiency)[order]):
        if e < threshold:
            return int(w)
    return None


def bottleneck_table(eff: pd.DataFrame, threshold: float = EFFICIENCY_THRESHOLD) -> pd.DataFrame:
    """Per GPU, PS count and model: efficiency at each worker count and where the bottleneck starts."""
    rows = []
    for (gpu, ps, model), grp in eff.groupby(CONFIG_KEYS):
        row = {"gpu": gpu, "ps": int(ps), "model": model,
               "single_steps_per_s": float(grp["single_steps_per_s"].iloc[0]),
               "bottleneck_workers": knee(grp["workers"].to_numpy(), grp["efficiency"].to_numpy(), threshold),
               "max_steps_per_s": float(grp["steps_per_s"].max())}
        row.update({f"eff_w{int(w)}": float(e) for w, e in zip(grp["workers"], grp["efficiency"])})
        rows.append(row)
    table = pd.DataFrame(rows)
    table["bottleneck_workers"] = table["bottleneck_workers"].astype("Int64")  # missing: no bottleneck
    return table


@dataclass(frozen=True)
class ScalingLaw:
    """Cluster throughput = smooth-min(workers x single throughput, PS capacity)."""

    ms_per_tensor: float
    bandwidth_mb_s: float
    sharpness: float
    ps_exponent: float

    def capacity(self, tensors, params, ps):
        """Global steps/s the parameter servers can serve."""
        service_s = (self.ms_per_tensor * np.asarray(tensors) / 1e3
                     + np.asarray(params) * BYTES_PER_PARAMETER / (self.bandwidth_mb_s * 1e6))
        return np.power(np.asarray(ps, dtype=float), self.ps_exponent) / service_s

    def throughput(self, single_steps_per_s, workers, tensors, params, ps):
        """Predicted global steps/s of `workers` workers, each alone running `single_steps_per_s`."""
        linear = np.asarray(workers, dtype=float) * np.asarray(single_steps_per_s, dtype=float)
        cap = self.capacity(tensors, params, ps)
        k = self.sharpness
        return np.power(np.power(linear, -k) + np.power(cap, -k), -1.0 / k)


def _law_inputs(eff: pd.DataFrame, meta: pd.DataFrame) -> pd.DataFrame:
    df = eff.join(meta[["tensors", "params"]], on="model")
    missing = df[df["tensors"].isna()]["model"].unique()
    if len(missing):
        raise ValueError(f"no tensor/parameter counts for models {list(missing)}")
    return df


def fit_scaling_law(eff: pd.DataFrame, meta: pd.DataFrame) -> ScalingLaw:
    """Fit the law's four parameters to measured throughput by least squares on log throughput."""
    df = _law_inputs(eff, meta)

    def law(q: np.ndarray) -> ScalingLaw:
        return ScalingLaw(float(np.exp(q[0])), float(np.exp(q[1])), float(np.exp(q[2])), float(q[3]))

    def residual(q: np.ndarray) -> np.ndarray:
        pred = law(q).throughput(df["single_steps_per_s"], df["workers"], df["tensors"], df["params"],
                                 df["ps"])
        return np.log(pred) - np.log(df["steps_per_s"].to_numpy())

    start = np.array([np.log(0.1), np.log(500.0), np.log(4.0), 1.0])
    return law(least_squares(residual, start).x)


def model_meta(speed: pd.DataFrame) -> pd.DataFrame:
    """Tensor and parameter counts per model, from the single-worker speed table."""
    return speed.groupby("model")[["tensors", "params"]].first()


@dataclass
class ScalingReport:
    """Bottleneck table, fitted law and how well the law and plain linear scaling predict throughput."""

    efficiency: pd.DataFrame
    bottlenecks: pd.DataFrame
    law: ScalingLaw
    law_mape: dict[str, float]
    linear_mape: dict[str, float]
    leave_one_model_out_mape: dict[str, float]
    threshold: float

    def to_json(self) -> dict:
        return {"threshold": self.threshold, "law": asdict(self.law), "law_mape": self.law_mape,
                "linear_mape": self.linear_mape, "leave_one_model_out_mape": self.leave_one_model_out_mape,
                "bottlenecks": self.bottlenecks.astype(object).where(self.bottlenecks.notna(), None)
                .to_dict(orient="records")}


def _config_label(gpu: str, ps: int) -> str:
    return f"{gpu}, {ps} PS"


def scaling_report(cluster: pd.DataFrame, speed: pd.DataFrame,
                   threshold: float = EFFICIENCY_THRESHOLD) -> ScalingReport:
    """Analyse the cluster runs: bottlenecks, the fitted law, in-sample and leave-one-model-out errors."""
    eff = efficiency_table(cluster)
    meta = model_meta(speed)
    df = _law_inputs(eff, meta)
    law = fit_scaling_law(eff, meta)
    df["law"] = law.throughput(df["single_steps_per_s"], df["workers"], df["tensors"], df["params"], df["ps"])
    law_mape, linear_mape = {}, {}
    for (gpu, ps), grp in df.groupby(["gpu", "ps"]):
        label = _config_label(gpu, int(ps))
        law_mape[label] = mape(grp["steps_per_s"], grp["law"])
        linear_mape[label] = mape(grp["steps_per_s"], grp["linear_steps_per_s"])
    law_mape["all"] = mape(df["steps_per_s"], df["law"])
    linear_mape["all"] = mape(df["steps_per_s"], df["linear_steps_per_s"])
    lomo = {}
    for model in sorted(df["model"].unique()):
        held = df[df["model"] == model]
        fitted = fit_scaling_law(eff[eff["model"] != model], meta)
        pred = fitted.throughput(held["single_steps_per_s"], held["workers"], held["tensors"],
                                 held["params"], held["ps"])
        lomo[model] = mape(held["steps_per_s"], pred)
    return ScalingReport(eff, bottleneck_table(eff, threshold), law, law_mape, linear_mape, lomo, threshold)
