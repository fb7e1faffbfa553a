"""Workload profiles for the planner: seconds per global training step for each GPU type, number of
parameter servers and number of workers, plus the time one checkpoint takes.

A profile comes from a YAML file or is derived for a CM-DARE model: single-worker step time from
the step-time model selected by CV (grouped by model), GPUs measured only in `speed_data_base`
(V100) scaled from the most consistent measured GPU, cluster throughput from the fitted
parameter-server scaling law, checkpoint time from the checkpoint model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import Field
from sklearn.model_selection import GroupKFold

from cocoweave.cluster.cmdare import tables as data
from cocoweave.cluster.cmdare.features import speed_features
from cocoweave.cluster.cmdare.ps_scaling import efficiency_table, fit_scaling_law, model_meta
from cocoweave.cluster.cmdare.regression import CV_FOLDS, log_space_candidates, select
from cocoweave.cluster.planning.checkpoint_model import fit_checkpoint_model
from cocoweave.cluster.schema import Strict, validate
from cocoweave.cluster.yamlio import load_yaml
from cocoweave.errors import PlanningError


@dataclass(frozen=True)
class ProfilePoint:
    """Seconds per global step with `workers` workers of one GPU type and `ps` parameter servers; with
    `machine`, only on that catalog machine (a modelled step depends on its networks too)."""

    gpu: str
    ps: int
    workers: int
    step_time_s: float
    machine: str | None = None


@dataclass(frozen=True)
class WorkloadProfile:
    """A workload's predicted speed per configuration, its checkpoint time, and how both were obtained
    (`modelled`: predicted for hardware it was not measured on)."""

    name: str
    checkpoint_s: float
    points: tuple[ProfilePoint, ...]
    notes: tuple[str, ...] = ()
    modelled: bool = False

    @property
    def gpus(self) -> set[str]:
        return {p.gpu for p in self.points}


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise PlanningError(f"{where} must be a positive number, got {value!r}.")
    return float(value)


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanningError(f"{where} must be a positive integer, got {value!r}.")
    return value


class _Profile(Strict):
    name: str = Field(min_length=1)
    checkpoint_s: float = Field(gt=0, allow_inf_nan=False)
    parameter_servers: int = Field(default=1, ge=0)
    step_time_s: dict[str, dict[Any, Any]] = Field(min_length=1)


def parse_profile(doc: Any, source: str) -> WorkloadProfile:
    """Validate a profile document: name, checkpoint_s, parameter_servers (default 1; 0 for a job without them)
    and step_time_s: {GPU: {workers: seconds per global step}}; unknown keys are refused with the keys allowed."""
    prof = validate(_Profile, doc, source, "workload profile")
    points = []
    for gpu, per_workers in prof.step_time_s.items():
        if not per_workers:
            raise PlanningError(f"{source}: step_time_s[{gpu!r}] must map worker counts to seconds.")
        for workers, seconds in per_workers.items():
            where = f"{source}: step_time_s[{gpu!r}][{workers!r}]"
            points.append(ProfilePoint(str(gpu).upper(), prof.parameter_servers,
                                       _count(workers, f"{where} worker count"), _positive(seconds, where)))
    return WorkloadProfile(prof.name, prof.checkpoint_s, tuple(points), (f"profile read from {source}",))


def load_profile(path: str | os.PathLike) -> WorkloadProfile:
    """Read and validate a YAML workload profile."""
    return parse_profile(load_yaml(path, "profile"), str(path))


def transfer_ratio(base: pd.DataFrame, target: str, reference: str) -> tuple[float, float, int]:
    """Geometric-mean step-time ratio target/reference over models measured on both, its log-spread
    (std of log ratios) and the number of models."""
    wide = base.pivot_table(index="model", columns="gpu", values="step_time_s")
    wide = wide.dropna(subset=[target, reference])
    logs = np.log(wide[target] / wide[reference])
    return float(np.exp(logs.mean())), float(logs.std(ddof=0)), len(logs)


def single_worker_step_times(speed: pd.DataFrame, base: pd.DataFrame, model: str) -> tuple[dict[str, float],
                                                                                             list[str]]:
    """Predicted single-worker step time of `model` (a slug present in `speed`) per GPU, with notes."""
    times, notes = {}, []
    for gpu in sorted(speed["gpu"].unique()):
        rows = speed[speed["gpu"] == gpu]
        sel = select(log_space_candidates(), speed_features(rows), rows["step_time_s"],
                     GroupKFold(CV_FOLDS), groups=rows["model"])
        times[gpu] = float(sel.predict(speed_features(rows[rows["model"] == model].iloc[:1]))[0])
        notes.append(f"{gpu}: single-worker step time {times[gpu]:.4f} s from {sel.name} "
                     f"(CV MAPE {sel.cv_mape:.1f}% on unseen models)")
    for gpu in sorted(set(base["gpu"]) - set(times)):
        ratios = {ref: transfer_ratio(base, gpu, ref) for ref in times}
        ref = min(ratios, key=lambda r: ratios[r][1])
        ratio, spread, n = ratios[ref]
        times[gpu] = times[ref] * ratio
        notes.append(f"{gpu}: {ref} prediction x {ratio:.3f} (geometric mean of {n} models measured on both; "
                     f"log-ratio spread {spread:.3f})")
    return times, notes


def profile_for_model(model: str, data_dir: Path, max_workers: int = 8, max_ps: int = 2) -> WorkloadProfile:
    """Derive a profile for a CM-DARE model over 1..max_workers workers and 1..max_ps parameter servers."""
    speed = data.load_speed(data_dir)
    slug = data.canonical_model(model)
    if slug not in set(speed["model"]):
        known = ", ".join(sorted(set(speed["model"])))
        raise PlanningError(f"unknown model {model!r}; CM-DARE models: {known}.")
    times, notes = single_worker_step_times(speed, data.load_base_step_times(data_dir), slug)
    meta = model_meta(speed)
    law = fit_scaling_law(efficiency_table(data.load_cluster_throughput(data_dir)), meta)
    notes.append(f"cluster throughput: PS scaling law ({law.ms_per_tensor:.3f} ms/tensor + bytes at "
                 f"{law.bandwidth_mb_s:.0f} MB/s per step; p servers x p^{law.ps_exponent:.2f})")
    tensors, params = meta.loc[slug, "tensors"], meta.loc[slug, "params"]
    points = []
    for gpu, step_s in times.items():
        for ps in range(1, max_ps + 1):
            for workers in range(1, max_workers + 1):
                rate = float(law.throughput(1.0 / step_s, workers, tensors, params, ps))
                points.append(ProfilePoint(gpu, ps, workers, 1.0 / rate))
    ckpt = fit_checkpoint_model(data_dir)
    size = ckpt.size_mb(slug)
    checkpoint_s = ckpt.duration_s(size)
    notes.append(f"checkpoint: {size:.1f} MB -> {checkpoint_s:.2f} s from {ckpt.selection.name} "
                 f"(CV MAPE {ckpt.selection.cv_mape:.1f}%)")
    return WorkloadProfile(slug, checkpoint_s, tuple(points), tuple(notes))
