"""`cocoweave profile` on the two first users (reduced: tiny sizes, few steps), `plan --profile` on what it
wrote, and bad input as one sentence with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cocoweave.cli import app
from cocoweave.perf.store import MeasurementStore

ROOT = Path(__file__).resolve().parents[2]
TINY_LM = ["--vocab", "32", "--d-model", "16", "--heads", "2", "--layers", "1", "--context", "8", "--batch", "2",
           "--log-every", "0"]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def lm_profile(tmp_path_factory):
    """train_lm.py (DDP + AdamW) fitted on 1 and 2 ranks, 3 predicted and measured."""
    folder = tmp_path_factory.mktemp("lm")
    out = folder / "lm.json"
    r = invoke("profile", ROOT / "examples/train_lm.py", "-n", "1,2", "--predict", "3,16", "--rounds", 1, "--steps", 3,
               "--warmup", 2, "--json", out, "--store", folder / "store", "--png", folder / "scaling.png", "--",
               *TINY_LM)
    assert r.exit_code == 0, r.output
    return r, out, folder


def test_profile_fits_predicts_checks_and_stores(lm_profile):
    r, out, folder = lm_profile
    doc = json.loads(out.read_text())
    assert doc["fit_world_sizes"] == [1, 2] and [w["world_size"] for w in doc["runs"]] == [1, 2, 3]
    three, sixteen = doc["predictions"]
    assert three["world_size"] == 3 and three["measured_ms"] > 0 and three["error_pct"] is not None
    assert sixteen["measured_ms"] is None  # more than 4 x the cores: predicted only
    assert doc["validation_mape_pct"] == pytest.approx(abs(three["error_pct"]))
    assert doc["runs"][1]["collectives"]["all_reduce/ddp/p2"]["bytes"] > 0
    assert doc["modelled"]["steps"] and "MODELLED" in doc["modelled"]["note"]
    assert "Bottleneck:" in r.output and "Prediction error" in r.output and "MODELLED" in r.output
    rows = MeasurementStore(folder / "store").load()
    assert sorted(rows["world_size"]) == [1, 2, 3] and set(rows["program"]) == {"script:train_lm"}
    assert (folder / "scaling.png").read_bytes()[:4] == b"\x89PNG" and "plot written to" in r.output


def test_plan_recommends_a_gpu_configuration_from_the_profile(lm_profile):
    _, out, _ = lm_profile
    r = invoke("plan", "--profile", out, "--budget", 100)
    assert r.exit_code == 0, r.output
    assert "Recommended" in r.output and "(modelled)" in r.output and "MODELLED" in r.output
    png = out.with_name("lm-plan.png")  # beside the run's JSON, not in the current directory
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = invoke("plan", "--profile", out, "--deadline", 1000, "--steps", 10, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["modelled"] and doc["steps"] == 10 and doc["recommended"]["hours"] <= 1000


def test_plan_reads_json_numbers_yaml_would_misread(lm_profile, tmp_path):
    _, out, _ = lm_profile
    doc = json.loads(out.read_text())
    doc["runs"][0]["cpu_ms"]["cpu_other_ms"] = 1e-05  # json writes 1e-05, which YAML 1.1 reads as a string
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    r = invoke("plan", "--profile", edited, "--budget", 100, "--png", tmp_path / "p.png")
    assert r.exit_code == 0, r.output


def test_train_gpt_under_the_profiler_json_on_stdout(tmp_path):
    # no --predict: measuring a predicted size (and the core sharing beyond the cores) is test_profile_fits_...'s
    r = invoke("profile", ROOT / "examples/train_gpt.py", "-n", "1,2", "--rounds", 1, "--steps", 2,
               "--warmup", 2, "--json", "-", "--store", tmp_path / "store")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # only JSON on stdout; no tables are printed
    assert doc["script_args"] == ["--tensor-parallel", "1", "--batch", "24"]  # its '# cocoweave profile:' line
    assert doc["runs"][0]["optimizer"] == "cocoweave.optim.optimizers.DistributedAdamW"
    assert [w["world_size"] for w in doc["runs"]] == [1, 2] and doc["runs"][1]["step_ms"] > 0
    kinds = {k.split("/")[0] for k in doc["runs"][1]["collectives"]}
    assert {"reduce_scatter", "all_gather"} <= kinds  # the optimizer's gradient reduction and parameter gather
    assert not doc["bottleneck"].startswith("input-bound")  # its batches are made in the loop, no loader waited on
    assert doc["io"]["checkpoint"] is None and doc["io"]["worlds"][0]["transfers"]["ms"] == 0.0  # none; no GPU


@pytest.mark.parametrize("args, words", [
    (["missing.py"], "does not exist"),
    ([ROOT / "examples/train_lm.py", "-n", "2"], "at least two sizes"),
    ([ROOT / "examples/train_lm.py", "-n", "1,x"], "must look like 4, 1-8 or 1,2,4"),
    ([ROOT / "examples/train_gpt.py", "-n", "1,2", "--steps", 1, "--", "--tensor-parallel", 2],
     "--tensor-parallel 2 must divide the world size 1"),
])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, words):
    r = invoke("profile", args[0], "--store", tmp_path / "store", *args[1:])
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output


def test_json_into_a_folder_is_refused_before_any_run(tmp_path):
    r = invoke("profile", ROOT / "examples/train_lm.py", "--json", tmp_path)
    assert r.exit_code == 2 and "is a folder" in r.output
    r = invoke("profile", ROOT / "examples/train_lm.py", "--png", tmp_path / "missing" / "p.png")
    assert r.exit_code == 2 and "--png" in r.output and "does not exist" in r.output
