"""`cocoweave schedules`, `check` and `show --schedule` as a user runs them."""

import json
from pathlib import Path

from typer.testing import CliRunner

from cocoweave.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_schedules_lists_adam_recipe():
    r = invoke("schedules", ROOT / "examples/adam.py:adam", "--size", "N=64", "--json", "-")
    assert r.exit_code == 0, r.output
    names = [s["name"] for s in json.loads(r.stdout)]
    for want in ("AR-C", "RS-C-AG", "RS-C-AG+slice(m,v)", "fuse(RS-C-AG)"):
        assert want in names


def test_check_every_example_passes_at_several_world_sizes():
    for spec, sizes, worlds in [("adam.py:adam", ["N=33"], "1-3"), ("lamb.py:lamb", ["N=33"], "2,5"),
                                ("model_parallel.py:layer", ["B=2", "S=6", "H=10"], "3"),
                                ("pipeline_parallel.py:boundary", ["B=2", "S=6", "H=10"], "1-4")]:
        args = ["check", ROOT / "examples" / spec, "-n", worlds, "--json", "-"] + [x for s in sizes for x in ("-s", s)]
        r = invoke(*args)
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        assert data["ok"] and data["rows"] and all(row["ok"] for row in data["rows"])
        if spec.startswith("pipeline"):
            assert sorted(data["skipped"]) == ["1", "3"]


def test_check_table_and_single_schedule():
    r = invoke("check", ROOT / "examples/adam.py:adam", "-s", "N=20", "-n", "2", "--schedule", "fuse(RS-C-AG)")
    assert r.exit_code == 0, r.output
    assert "fuse(RS-C-AG)" in r.stdout and "yes" in r.stdout


def test_show_schedule_prints_steps_program_and_plan():
    r = invoke("show", ROOT / "examples/model_parallel.py:layer", "-s", "B=2", "-s", "S=8", "-s", "H=16",
               "--schedule", "ol(MM,fuse(RS-C-AG),4)")
    assert r.exit_code == 0, r.output
    assert "step split(" in r.stdout and "step overlap(" in r.stdout
    assert "plan ol(MM,fuse(RS-C-AG),4)" in r.stdout and "0: ol(MM,fuse(RS-C-AG),4)" in r.stdout


def test_bad_requests_exit_2_with_a_sentence():
    r = invoke("show", ROOT / "examples/adam.py:adam", "--schedule", "nope")
    assert r.exit_code == 2 and "has no schedule 'nope'; its schedules are: AR-c" in r.output
    r = invoke("check", ROOT / "examples/pipeline_parallel.py:boundary", "-n", "3")
    assert r.exit_code == 2 and "world size 3 cannot be split into 2 equal pipeline stages" in r.output
    r = invoke("check", ROOT / "examples/adam.py:adam", "-n", "x")
    assert r.exit_code == 2 and "must look like 4, 1-8 or 1,2,4" in r.output
    r = invoke("check", ROOT / "examples/adam.py:adam", "--backend", "mpi")
    assert r.exit_code == 2 and "backend 'mpi' is not available" in r.output
