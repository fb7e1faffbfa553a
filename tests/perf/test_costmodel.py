"""The analytic cost model: alpha-beta fitting recovers known constants; plans are priced by the terms
the design names (bytes moved per collective, memory traffic per kernel, a pipeline for overlap)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cocoweave.errors import CocoweaveError
from cocoweave.ir.loader import load_example
from cocoweave.perf.costmodel import (
    AlphaBeta,
    Calibration,
    calibration_path,
    fit_alpha_beta,
    load_calibration,
    predict_plan,
    save_calibration,
)
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules

FREE = AlphaBeta(0.0, 0.0)


def _cal(collectives=None, kernel=FREE, matmul=FREE, chunk=0.0) -> Calibration:
    return Calibration("torch", "cpu", 4, dict(collectives or {}), {"float32": kernel, "float16": kernel},
                       {"float32": matmul, "float16": matmul}, chunk_overhead_ms=chunk)


def _schedules(spec: str, **sizes):
    return {s.name: s for s in enumerate_schedules(load_example(spec, **sizes))}


def test_fit_recovers_known_alpha_and_beta_from_exact_and_noisy_data():
    sizes = np.array([1e3, 1e4, 1e5, 1e6, 4e6])
    exact = fit_alpha_beta(sizes, 0.5 + 2.0 * sizes / 1e6)
    assert exact.alpha_ms == pytest.approx(0.5, rel=1e-6) and exact.beta_ms_per_mb == pytest.approx(2.0, rel=1e-6)
    rng = np.random.default_rng(0)
    noisy = fit_alpha_beta(np.repeat(sizes, 5), (0.5 + 2.0 * np.repeat(sizes, 5) / 1e6) * rng.uniform(0.97, 1.03, 25))
    assert noisy.alpha_ms == pytest.approx(0.5, rel=0.05) and noisy.beta_ms_per_mb == pytest.approx(2.0, rel=0.05)


def test_fit_never_returns_negative_constants_and_refuses_too_few_points():
    line = fit_alpha_beta([1e3, 1e6], [5.0, 4.0])  # time falls with size: the best non-negative line is flat
    assert line.alpha_ms > 0 and line.beta_ms_per_mb == 0.0
    with pytest.raises(CocoweaveError, match="needs >= 2 positive timings"):
        fit_alpha_beta([1e3], [1.0])


def test_all_reduce_is_priced_by_ring_bytes_per_rank():
    n = 4096
    s = _schedules("adam.py:adam", N=n)["AR-c"]
    pred = predict_plan(lower(s), {}, 4, _cal({"all_reduce/library": AlphaBeta(1.0, 10.0)}))
    moved = 2 * 3 / 4 * 4 * n  # 2 (p-1)/p of the fp32 gradient
    assert pred.stage_ms["0:AR"] == pytest.approx(1.0 + 10.0 * moved / 1e6)
    assert pred.total_ms == pytest.approx(pred.stage_ms["0:AR"])  # kernels cost nothing here
    assert pred.features["comm_mb"] == pytest.approx(moved / 1e6)


def test_sliced_state_moves_a_quarter_of_the_kernel_traffic():
    found = _schedules("adam.py:adam", N=4096)
    cal = _cal(kernel=AlphaBeta(0.0, 1.0))
    whole = predict_plan(lower(found["AR-C"]), {}, 4, cal)
    sliced = predict_plan(lower(found["RS-C+slice(m,v,w)"]), {}, 4, cal)
    assert sliced.features["traffic_mb"] == pytest.approx(whole.features["traffic_mb"] / 4)
    assert sliced.total_ms < whole.total_ms


def test_overlapped_chain_is_a_pipeline_of_its_parts():
    found = _schedules("model_parallel.py:layer", B=2, S=8, H=64)
    cal = _cal({"all_reduce/library": AlphaBeta(0.0, 100.0)}, matmul=AlphaBeta(0.0, 1.0), chunk=1e-4)
    serial = predict_plan(lower(found["MM-AR-C"]), {}, 4, cal).stage_ms
    mm, ar = serial["0:MM"], serial["1:AR"]
    for k in (2, 4):
        pred = predict_plan(lower(found[f"ol(MM,AR,{k})-C"]), {}, 4, cal)
        expected = (mm + ar) / k + (k - 1) * max(mm, ar) / k + k * 1e-4
        assert pred.stage_ms[f"0:ol(MM,AR,{k})"] == pytest.approx(expected)
        assert pred.features["overlap_saved_ms"] > 0


def test_calibration_round_trips_through_json_and_bad_files_are_one_sentence(tmp_path):
    cal = _cal({"all_reduce/ring": AlphaBeta(0.2, 3.0)})
    path = save_calibration(cal, calibration_path("torch", "cpu", 4, tmp_path))
    assert path.name == "calibration-torch-cpu-w4.json" and not list(tmp_path.glob(".tmp-*"))
    back = load_calibration("torch", "cpu", 4, tmp_path)
    assert back == cal and back.collective("all_reduce", "ring") == AlphaBeta(0.2, 3.0)
    assert back.collective("reduce_scatter", "ring") == AlphaBeta(0.2, 3.0)  # falls back to all_reduce lines
    assert load_calibration("torch", "cpu", 8, tmp_path) is None
    path.write_text(json.dumps({"backend": "torch"}))
    with pytest.raises(CocoweaveError, match="not a valid calibration file"):
        load_calibration("torch", "cpu", 4, tmp_path)


def test_all_to_all_is_priced_by_the_part_each_rank_sends_away():
    import cocoweave as cw
    from cocoweave.schedule.schedule import Schedule

    p = cw.Program("a2a")
    x = p.tensor("x", (8, 64, 16), "float32", cw.Sliced(0))
    p.output(cw.all_to_all(x, 1), "y")
    pred = predict_plan(lower(Schedule(p)), {}, 4, _cal({"all_to_all/library": AlphaBeta(1.0, 10.0)}))
    moved = 3 / 4 * 4 * (8 // 4) * 64 * 16  # (p-1)/p of this rank's fp32 part [2, 64, 16]
    assert pred.stage_ms["0:A2A"] == pytest.approx(1.0 + 10.0 * moved / 1e6)
    assert pred.features["comm_mb"] == pytest.approx(moved / 1e6)
