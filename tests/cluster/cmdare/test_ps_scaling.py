"""Parameter-server bottleneck detection and the scaling law, on synthetic curves with known answers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cocoweave.cluster.cmdare.ps_scaling import (
    ScalingLaw,
    bottleneck_table,
    efficiency_table,
    fit_scaling_law,
    knee,
)


def cluster(curves: dict[tuple[str, int, str], list[float]]) -> pd.DataFrame:
    rows = [{"gpu": gpu, "ps": ps, "model": model, "workers": w, "steps_per_s": rate}
            for (gpu, ps, model), rates in curves.items() for w, rate in enumerate(rates, start=1)]
    return pd.DataFrame(rows)


def test_knee_is_the_first_worker_count_below_threshold():
    workers = np.arange(1, 9)
    capped = np.minimum(10.0 * workers, 45.0)  # capacity 45 steps/s: 90% at 5 workers, 75% at 6
    assert knee(workers, capped / (10.0 * workers)) == 6
    assert knee(workers, np.ones(8)) is None
    assert knee(workers[::-1], (capped / (10.0 * workers))[::-1]) == 6  # order of rows does not matter


def test_bottleneck_table_finds_the_knee_per_configuration():
    w = np.arange(1, 9)
    df = cluster({("P100", 1, "m"): list(np.minimum(10.0 * w, 45.0)),
                  ("K80", 1, "m"): list(4.0 * w)})
    table = bottleneck_table(efficiency_table(df)).set_index("gpu")
    assert table.loc["P100", "bottleneck_workers"] == 6
    assert table.loc["P100", "eff_w8"] == pytest.approx(45.0 / 80.0)
    assert pd.isna(table.loc["K80", "bottleneck_workers"])
    assert table.loc["K80", "eff_w8"] == pytest.approx(1.0)


def test_scaling_law_fit_recovers_known_parameters():
    truth = ScalingLaw(ms_per_tensor=0.1, bandwidth_mb_s=500.0, sharpness=6.0, ps_exponent=0.5)
    meta = pd.DataFrame({"tensors": [50.0, 216.0, 104.0], "params": [7e5, 2.6e7, 1.9e6]},
                        index=pd.Index(["a", "b", "c"], name="model"))
    single = {"a": 20.0, "b": 2.0, "c": 11.0}
    curves = {}
    for gpu_ps in (("P100", 1), ("P100", 2)):
        for model in meta.index:
            w = np.arange(1, 9)
            curves[(*gpu_ps, model)] = list(truth.throughput(
                single[model], w, meta.loc[model, "tensors"], meta.loc[model, "params"], gpu_ps[1]))
    df = cluster(curves)
    eff = efficiency_table(df)
    # efficiency_table normalises by the measured 1-worker rate, which the law already bends slightly
    fitted = fit_scaling_law(eff, meta)
    pred = fitted.throughput(eff["single_steps_per_s"], eff["workers"], eff.join(meta, on="model")["tensors"],
                             eff.join(meta, on="model")["params"], eff["ps"])
    assert np.max(np.abs(pred / eff["steps_per_s"] - 1)) < 0.02
    assert fitted.ps_exponent == pytest.approx(0.5, abs=0.05)
    assert fitted.bandwidth_mb_s == pytest.approx(500.0, rel=0.1)


def test_more_parameter_servers_raise_capacity_and_linear_regime_is_kept():
    law = ScalingLaw(ms_per_tensor=0.1, bandwidth_mb_s=600.0, sharpness=8.0, ps_exponent=0.5)
    one, two = (law.throughput(20.0, 8, 50, 7e5, ps) for ps in (1, 2))
    assert two > one
    assert law.throughput(0.5, 2, 50, 7e5, 1) == pytest.approx(1.0, rel=1e-3)  # far below the cap
