"""`cocoweave tune` end to end on 2 ranks and tiny sizes; `perf predict` and user errors of the new commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cocoweave.cli import app
from cocoweave.perf.costmodel import AlphaBeta, Calibration, calibration_path, save_calibration
from cocoweave.perf.store import MeasurementStore

ADAM = str(Path(__file__).resolve().parents[2] / "examples" / "adam.py") + ":adam"
runner = CliRunner()


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COCOWEAVE_STORE", raising=False)
    monkeypatch.delenv("COCOWEAVE_TUNE_CACHE", raising=False)
    monkeypatch.delenv("COCOWEAVE_CALIBRATION_DIR", raising=False)
    return tmp_path


def _calibrate(world_size: int) -> None:
    line = AlphaBeta(0.1, 1.0)
    save_calibration(Calibration("torch", "cpu", world_size, {"all_reduce/library": line}, {"float32": line},
                                 {"float32": line}), calibration_path("torch", "cpu", world_size))


def test_tune_measures_k_plus_baseline_records_them_and_caches_the_choice(workdir):
    _calibrate(2)
    result = runner.invoke(app, ["tune", ADAM, "-n", "2", "-s", "N=64", "-k", "1", "--iters", "2", "--warmup", "1",
                                 "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "chose" in result.output and "★" in result.output
    df = MeasurementStore(workdir / ".cocoweave" / "store").load()
    assert 1 <= len(df) <= 2 and set(json.loads(df["extra"].iloc[0])) >= {"predicted_ms", "features", "times_ms"}
    entries = json.loads((workdir / ".cocoweave" / "tune-cache.json").read_text())["entries"]
    (entry,) = entries.values()
    assert entry["schedule"] in set(df["schedule"]) and entry["measured_ms"] <= entry["baseline_ms"]


def test_perf_predict_ranks_every_schedule_and_needs_a_calibration(workdir):
    result = runner.invoke(app, ["perf", "predict", ADAM, "-n", "4", "-s", "N=1024"])
    assert result.exit_code == 2 and "cocoweave perf calibrate --world-size 4" in result.output
    _calibrate(4)
    result = runner.invoke(app, ["perf", "predict", ADAM, "-n", "4", "-s", "N=1024"])
    assert result.exit_code == 0, result.output
    assert "AR-c" in result.output and "RS-C+slice(m,v,w)" in result.output


@pytest.mark.parametrize("args, words", [
    (["tune", ADAM, "-n", "2", "-s", "M=3"], "has no size `M`"),
    (["measure", "nofile.py:f", "-n", "2"], "no such program file"),
    (["measure", ADAM, "-n", "0"], "must be positive"),
    (["perf", "accuracy"], "accuracy report needs"),
])
def test_user_errors_exit_2_with_one_sentence(workdir, args, words):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_every_new_command_is_registered_on_the_cocoweave_app():
    perf = runner.invoke(app, ["perf", "--help"])
    assert perf.exit_code == 0 and all(c in perf.output for c in ("cmdare", "calibrate", "predict", "accuracy"))
    for command in ("plan", "measure", "tune"):
        assert runner.invoke(app, [command, "--help"]).exit_code == 0


def test_perf_calibrate_writes_the_calibration_prints_the_fit_and_stores_the_timings(workdir):
    result = runner.invoke(app, ["perf", "calibrate", "-n", "1", "--iters", "2"])
    assert result.exit_code == 0, result.output
    assert "kernel float32" in result.output and "matmul float16" in result.output
    doc = json.loads((workdir / ".cocoweave" / "calibration-torch-cpu-w1.json").read_text())
    assert doc["world_size"] == 1 and set(doc["kernels"]) == {"float32", "float16", "bfloat16"}
    df = MeasurementStore(workdir / ".cocoweave" / "store").load()
    assert set(df["program"]) == {"microbenchmark:kernel", "microbenchmark:matmul"} and (df["total_ms"] > 0).all()
