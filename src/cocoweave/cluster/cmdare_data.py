"""Loaders for the CM-DARE measurement tables (Li, Walls, Guo, ICDCS 2020), normalised to tidy frames.

Model names differ between the paper's tables ("ResNet-15", "Res15", "res15k80worker1"); every loader
maps them to one slug (`canonical_model`) so tables can be joined.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pandas as pd

from cocoweave import settings
from cocoweave.errors import CocoweaveError

DATA_ENV = settings.CMDARE_DATA.name
PACKAGED_DATA = Path(__file__).resolve().parent / "data" / "cmdare"
HELD_OUT_MODELS = ("custom9", "custom10", "shakesmall32d", "shakemid32d")
# Vendor datasheet memory bandwidth per GPU die, GB/s (a K80 board holds two dies of 240.5 GB/s).
MEMORY_BANDWIDTH_GBS = {"K80": 240.5, "P100": 732.0, "V100": 900.0}
BYTES_PER_PARAMETER = 4  # the paper's models train in float32

_ALIASES = (("resnet", "res"), ("customres", "custom"), ("shakelarge", "shakebig"),
            ("shakesbig", "shakebig"), ("shake64", "shakemid"))


def canonical_model(name: str) -> str:
    """The slug of a model name: 'ResNet-32', 'Res32' and 'resnet32' all become 'res32'."""
    slug = re.sub(r"[^a-z0-9]", "", name.lower())
    for old, new in _ALIASES:
        slug = slug.replace(old, new)
    return slug


def find_data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The CM-DARE data folder: `explicit`, else $COCOWEAVE_CMDARE_DATA, else the copy shipped with the
    package (`cluster/data/cmdare`, Apache-2.0, see its LICENSE)."""
    given = explicit if explicit is not None else settings.CMDARE_DATA.text()
    path = Path(given) if given else PACKAGED_DATA
    if (path / "speed_data").is_dir():
        return path
    if given:
        raise CocoweaveError(f"{given} is not a CM-DARE data folder (it has no speed_data/ subfolder).")
    raise CocoweaveError(f"CM-DARE data not found: the package's copy {path} is missing; pass --data DIR or set "
                         f"{DATA_ENV}.")


def _read_csv(path: Path) -> pd.DataFrame:
    """Read one CSV, turning a missing or malformed file into a CocoweaveError naming it."""
    try:
        return pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise CocoweaveError(f"cannot read CM-DARE table {path}: {exc}") from exc


def _speed_frame(raw: pd.DataFrame) -> pd.DataFrame:
    """Tidy columns of a single-worker speed table."""
    out = pd.DataFrame({
        "model": raw["Model (temp)"].map(canonical_model),
        "gpu": raw["GPU (temp)"].astype(str),
        "flops": raw["Model FLOPs"].astype(float),
        "params": raw["Number of Parameters"].astype(float),
        "tensors": raw["Number of Tensors"].astype(float),
        "tflops": raw["GPU TFLOPS"].astype(float),
        "step_time_s": raw["Step Time (s)"].astype(float),
    })
    out["mem_bw_gbs"] = out["gpu"].map(MEMORY_BANDWIDTH_GBS)
    return out


def load_speed(data_dir: Path) -> pd.DataFrame:
    """Single-worker step times of 20 models on K80 and P100 (`0latency_norm_computation.csv`).

    The tensor count, a property of the model, is missing on some rows and is filled from the
    model's other rows."""
    df = _speed_frame(_read_csv(data_dir / "speed_data" / "0latency_norm_computation.csv"))
    df["tensors"] = df.groupby("model")["tensors"].transform("max")
    return df.reset_index(drop=True)


def load_heldout_k80(data_dir: Path) -> pd.DataFrame:
    """The paper's K80 test set of four models kept out of training (`0latency_k80_test.csv`)."""
    return _speed_frame(_read_csv(data_dir / "speed_data" / "0latency_k80_test.csv"))


def _checkpoint_frame(raw: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "model": raw["Model"].map(canonical_model),
        "size_mb": raw["Checkpoint Size (MB)"].astype(float),
        "duration_s": raw["Duration"].astype(float),
    })


def load_checkpoints(data_dir: Path) -> dict[str, pd.DataFrame]:
    """Checkpoint duration vs size: 'whole' (100 rows), and the paper's 'train'/'test' split by model."""
    folder = data_dir / "checkpoint"
    return {key: _checkpoint_frame(_read_csv(folder / name)) for key, name in
            (("whole", "whole_data.csv"), ("train", "unaggregated_training.csv"),
             ("test", "unaggregated_test.csv"))}


def load_checkpoint_sizes(data_dir: Path) -> pd.DataFrame:
    """Mean checkpoint size (MB) and parameter count per model (`checkpoint/aggregated.csv`)."""
    raw = _read_csv(data_dir / "checkpoint" / "aggregated.csv")
    return pd.DataFrame({"model": raw["Model"].map(canonical_model),
                         "size_mb": raw["Checkpoint Size (MB)"].astype(float),
                         "params": pd.to_numeric(raw["Number of Parameters"], errors="coerce")})


_CLUSTER_DIR = re.compile(r"^(?P<model>res15|res32|shakes?big|shakesmall)\D*?(?:k80|p100|80|100)"
                          r"(?:ps(?P<ps>\d))?worker(?P<workers>\d+)$")


def steady_throughput(values: pd.Series) -> float:
    """Steady-state throughput of one run: the median of the logged rates after the first interval."""
    tail = values.iloc[1:] if len(values) > 1 else values
    return float(tail.median())


def load_cluster_throughput(data_dir: Path) -> pd.DataFrame:
    """Cluster throughput (global steps/s) for 1..8 workers, per model, GPU and parameter-server count."""
    rows = []
    for csv in sorted((data_dir / "speed_and_cluster_size").glob("*/*/*.csv")):
        folder = csv.parent.name
        match = _CLUSTER_DIR.match(folder)
        if match is None:
            raise CocoweaveError(f"unexpected CM-DARE cluster folder name {folder!r} in {csv.parent.parent}")
        gpu = "K80" if csv.parent.parent.name.startswith("k80") else "P100"
        rows.append({"gpu": gpu, "ps": int(match["ps"] or 1), "model": canonical_model(match["model"]),
                     "workers": int(match["workers"]),
                     "steps_per_s": steady_throughput(_read_csv(csv)["Value"])})
    if not rows:
        raise CocoweaveError(f"no cluster throughput runs under {data_dir / 'speed_and_cluster_size'}")
    return pd.DataFrame(rows).sort_values(["gpu", "ps", "model", "workers"]).reset_index(drop=True)


def load_base_step_times(data_dir: Path) -> pd.DataFrame:
    """Median step time per model on K80, P100 and V100 (`speed_data_base/<model><gpu>/data.csv`)."""
    rows = []
    for csv in sorted((data_dir / "speed_data_base").glob("*/data.csv")):
        match = re.match(r"^(?P<model>.+?)(?P<gpu>k80|p100|v100)$", csv.parent.name)
        if match is None:
            continue
        rate = _read_csv(csv)["Value"]
        rows.append({"model": canonical_model(match["model"]), "gpu": match["gpu"].upper(),
                     "step_time_s": 1.0 / steady_throughput(rate[rate > 0])})
    return pd.DataFrame(rows)


def load_startup(data_dir: Path) -> pd.DataFrame:
    """VM startup seconds (provisioning + staging + booting) per GPU, pricing and region."""
    frames = []
    for csv in sorted((data_dir / "startup_time").glob("*/*.csv")):
        pricing, region = csv.parent.name.rsplit("_", 1)
        raw = _read_csv(csv)
        frames.append(pd.DataFrame({
            "gpu": "P100" if "p100" in csv.name else "K80",
            "pricing": "spot" if pricing == "pre" else "on-demand", "region": region,
            "startup_s": raw[["Provisioning", "Staging", "Booting"]].sum(axis=1).astype(float)}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        {"gpu": [], "pricing": [], "region": [], "startup_s": np.array([], dtype=float)})
