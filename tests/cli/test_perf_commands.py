"""`cocoweave perf predict|accuracy` as a user runs them: world sizes as 4, 1-8 or 1,2,4, JSON to a file or
stdout, and a sentence that says why nothing can be judged or predicted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cocoweave.cli import app
from cocoweave.perf.costmodel import AlphaBeta, Calibration, calibration_path, save_calibration

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """Calibrations of torch/cpu for 2 and 4 ranks in a private folder."""
    monkeypatch.setenv("COCOWEAVE_CALIBRATION_DIR", str(tmp_path / "cal"))
    line = AlphaBeta(0.05, 1.0)
    for w in (2, 4):
        cal = Calibration("torch", "cpu", w, {"all_reduce/library": line, "reduce_scatter/library": line,
                                              "all_gather/library": line}, {"float32": AlphaBeta(0.01, 0.5)},
                          {"float32": AlphaBeta(0.01, 0.001)})
        save_calibration(cal, calibration_path("torch", "cpu", w))
    return tmp_path


def test_predict_takes_a_list_of_world_sizes_and_writes_json_to_stdout(calibrated):
    r = invoke("perf", "predict", ROOT / "examples/adam.py:adam", "-s", "N=4096", "-n", "2,4", "--json", "-",
               "--store", calibrated / "store")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [p["world_size"] for p in doc["predictions"]] == [2, 4]
    assert all(p["schedules"] and p["correction"].startswith("not applied") for p in doc["predictions"])


def test_predict_names_the_missing_calibration(calibrated):
    r = invoke("perf", "predict", ROOT / "examples/adam.py:adam", "-n", "1-2", "--store", calibrated / "store")
    assert r.exit_code == 2
    assert "no calibration for torch/cpu on 1 ranks; run `cocoweave perf calibrate --world-size 1" in r.output


def test_accuracy_says_why_it_found_nothing(tmp_path):
    r = invoke("perf", "accuracy", "--store", tmp_path / "store", "--device", "cpu")
    assert r.exit_code == 2
    assert f"the store at {tmp_path / 'store'} has 0 measurements of device cpu" in " ".join(r.output.split())
    assert "run `cocoweave perf calibrate`" in r.output and "Traceback" not in r.output
