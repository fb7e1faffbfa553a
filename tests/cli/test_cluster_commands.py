"""The cluster-planning CLI: `cmdare` tables and JSON, `plan` output and PNG, and user errors as exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cocoweave.cli.cluster_commands import plan_command
from cocoweave.cli.perf_commands import perf_app
from cocoweave.cluster.cmdare import reproduce as cmdare_mod
from cocoweave.cluster.cmdare.tables import find_data_dir

CATALOG = Path(__file__).resolve().parents[2] / "examples" / "catalog.yaml"
PROFILE = """\
name: my-transformer
checkpoint_s: 20
step_time_s:
  K80: {1: 0.9, 2: 0.47, 4: 0.25, 8: 0.15}
  P100: {1: 0.35, 2: 0.18, 4: 0.1, 8: 0.07}
"""

app = typer.Typer()
app.add_typer(perf_app, name="perf")
app.command("plan")(plan_command)
runner = CliRunner()


@pytest.fixture
def profile_file(tmp_path) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(PROFILE)
    return path


def test_plan_from_a_profile_prints_the_front_and_writes_a_png(profile_file, tmp_path):
    png = tmp_path / "plan.png"
    result = runner.invoke(app, ["plan", "--profile", str(profile_file), "--catalog", str(CATALOG),
                                 "--steps", "100000", "--deadline", "10", "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert "Pareto front" in result.output and "Recommended" in result.output
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("args, words", [
    (["--deadline", "0.01"], "fastest achievable"),
    (["--budget", "0.01"], "cheapest is"),
    ([], "deadline"),
    (["--model", "res32", "--budget", "5"], "exactly one of"),
])
def test_plan_user_errors_exit_2_with_one_sentence(profile_file, tmp_path, args, words):
    result = runner.invoke(app, ["plan", "--profile", str(profile_file), "--catalog", str(CATALOG),
                                 "--steps", "100000", "--png", str(tmp_path / "p.png"), *args])
    assert result.exit_code == 2
    assert words in result.output and "Traceback" not in result.output
    assert not (tmp_path / "p.png").exists()


def test_plan_bad_yaml_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    result = runner.invoke(app, ["plan", "--profile", str(bad), "--catalog", str(CATALOG), "--steps", "10",
                                 "--budget", "5"])
    assert result.exit_code == 2 and "not valid YAML at line" in result.output


def test_cmdare_missing_data_exits_2(tmp_path):
    result = runner.invoke(app, ["perf", "cmdare", "--data", str(tmp_path)])
    assert result.exit_code == 2 and "not a CM-DARE data folder" in result.output


def test_cmdare_prints_tables_and_writes_json(tmp_path, monkeypatch):
    find_data_dir()  # the package ships the CM-DARE tables: a fresh clone has them
    fast = [c for c in cmdare_mod.log_space_candidates() if c.name in ("log ridge", "additive law")]
    monkeypatch.setattr(cmdare_mod, "log_space_candidates", lambda: fast)
    fit, reports = cmdare_mod.reproduce, []

    def reused(*args, **kwargs):
        reports[:] = reports or [fit(*args, **kwargs)]
        return reports[0]

    monkeypatch.setattr(cmdare_mod, "reproduce", reused)
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["perf", "cmdare", "--seeds", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "MAPE" in result.output and "PS bottleneck" in result.output and "(per-model mean)" in result.output
    doc = json.loads(out.read_text())
    assert {(r["protocol"], r["method"]) for r in doc["mape"]} >= {("a", "ours"), ("d", "SVR (paper)"),
                                                                    ("a", "per-model mean"), ("d", "per-model mean")}
    assert doc["mape"][0]["held_out"] and doc["mape"][0]["protocol"] == "c"  # held-out models lead
    assert doc["scaling"]["bottlenecks"] and doc["seeds"] == [0]
    # `--json -`: the same report as JSON on stdout (the fits, which take the time, ran once: `reused`)
    result = runner.invoke(app, ["perf", "cmdare", "--seeds", "1", "--json", "-"])
    assert result.exit_code == 0 and json.loads(result.stdout) | {"elapsed_s": 0} == doc | {"elapsed_s": 0}


def test_plan_writes_no_png_unless_asked(profile_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", "--profile", str(profile_file), "--catalog", str(CATALOG),
                                 "--steps", "1000", "--budget", "100", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert not list(tmp_path.glob("*.png")) and json.loads(result.stdout)["png"] is None
    result = runner.invoke(app, ["plan", "--profile", str(profile_file), "--budget", "100"])
    assert result.exit_code == 2 and "give --steps N" in result.output


def test_plan_predicts_a_resize_schedule_on_the_recommended_machine(profile_file, tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--profile", str(profile_file), "--catalog", str(CATALOG), "--steps", "500000",
            "--deadline", "100", "--json", str(out)]
    steady = runner.invoke(app, [*args, "--resizes", "8"])
    assert steady.exit_code == 0, steady.output
    at_8 = json.loads(out.read_text())["resizes"]["policies"]["keep_global"]
    resized = runner.invoke(app, [*args, "--resizes", "8:2,4:1,8"])
    assert resized.exit_code == 0, resized.output
    policies = json.loads(out.read_text())["resizes"]["policies"]
    keep, scale = policies["keep_global"], policies["scale (linear lr)"]
    assert keep["finished"] and [p["workers"] for p in keep["phases"]] == [8, 4, 8]
    assert sum(p["steps"] for p in keep["phases"]) >= 500000
    # an hour at half the workers, two more restarts and checkpoints: longer than 8 workers throughout
    assert keep["hours"] > at_8["hours"] and len(at_8["phases"]) == 1
    # scale: at 4 workers a step keeps the 8-worker step time and makes half a step of progress
    four = scale["phases"][1]
    assert four["progress"] == pytest.approx(four["kept"] / 2)
    assert "keep_global finishes" in resized.output and "scale (linear lr) finishes" in resized.output
    assert "Under the resize schedule 8:2,4:1,8" in resized.output


@pytest.mark.parametrize("schedule, words", [("8:x", "must look like RANKS:HOURS"), ("3:1,8", "no positive step time")])
def test_plan_bad_resize_schedule_exits_2(profile_file, schedule, words):
    result = runner.invoke(app, ["plan", "--profile", str(profile_file), "--catalog", str(CATALOG),
                                 "--steps", "100000", "--budget", "1000", "--resizes", schedule])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
