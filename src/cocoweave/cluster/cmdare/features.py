"""Feature builders for step-time and checkpoint-time models: ours (log, physically scaled) and the
features the paper's notebooks used for its baselines."""

from __future__ import annotations

import numpy as np
import pandas as pd

from cocoweave.cluster.cmdare.tables import BYTES_PER_PARAMETER


def speed_features(df: pd.DataFrame) -> pd.DataFrame:
    """Our features: log ideal compute time, log parameter bytes over memory bandwidth, log tensor count."""
    return pd.DataFrame({
        "log_compute_s": np.log(df["flops"] / (df["tflops"] * 1e12)),
        "log_param_io_s": np.log(df["params"] * BYTES_PER_PARAMETER / (df["mem_bw_gbs"] * 1e9)),
        "log_tensors": np.log(df["tensors"]),
    }, index=df.index)


def paper_speed_features(df: pd.DataFrame, agnostic: bool) -> pd.DataFrame:
    """The paper's single feature: model FLOPs per GPU, FLOPs / GPU TFLOPS across GPUs (its 'Model/GPU'
    column is an affine rescaling of this ratio, which leaves linear regression unchanged)."""
    if agnostic:
        return pd.DataFrame({"flops_per_tflops": df["flops"] / df["tflops"]}, index=df.index)
    return df[["flops"]]


def checkpoint_features(df: pd.DataFrame) -> pd.DataFrame:
    """Our checkpoint feature: log checkpoint size."""
    return pd.DataFrame({"log_size_mb": np.log(df["size_mb"])}, index=df.index)


def paper_checkpoint_features(df: pd.DataFrame) -> pd.DataFrame:
    """The paper's checkpoint feature: checkpoint size in MB."""
    return df[["size_mb"]]
