"""`cocoweave run / check / show --code` with the torch backend, as a user runs them. The commands spawn a
LocalWorld; here they borrow the session's worlds instead (spawning itself is tested in tests/test_launch.py)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cocoweave.launch
from cocoweave.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def spawned(local_world, monkeypatch):
    """The LocalWorlds the commands ask for, as (world_size, backend, device, timeout_s)."""
    asked = []

    class Borrowed:
        def __init__(self, world_size, backend="gloo", device="cpu", timeout_s=60.0, **_):
            asked.append((world_size, backend, device, timeout_s))
            self._world = local_world(world_size)
            self.world_size, self.backend, self.device = world_size, self._world.backend, self._world.device

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):  # the session's world stays open
            pass

        def run(self, fn, *args, **kwargs):
            return self._world.run(fn, *args, **kwargs)

        def call(self, fn, args=(), kwargs=None, timeout_s=None):
            return self._world.call(fn, args, kwargs, timeout_s)

    monkeypatch.setattr(cocoweave.launch, "LocalWorld", Borrowed)
    return asked


def test_check_torch_passes_every_schedule_and_exits_0(spawned):
    r = invoke("check", ROOT / "examples/adam.py:adam", "--size", "N=37", "--backend", "torch", "--world-size", 2,
               "--json", "-", "--timeout", 30)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["backend"] == "torch"
    names = {row["schedule"] for row in data["rows"]}
    assert {"AR-c", "AR@ring-C", "fuse(RS-C-AG)@ring+slice(m,v)"} <= names
    assert spawned == [(2, "auto", "cpu", 30.0)]


def test_run_torch_times_steps_writes_a_trace_and_matches_the_reference(spawned, tmp_path):
    program = [ROOT / "examples/model_parallel.py:layer", "-s", "B=4", "-s", "S=2", "-s", "H=8", "-n", 2, "--json", "-"]
    trace = tmp_path / "t.json"
    r = invoke("run", *program, "--backend", "torch", "--schedule", "ol(MM,AR,C,2)", "--iters", 3, "--trace", trace)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["schedule"] == "ol(MM,AR,C,2)" and len(data["step_ms"]) == 3 and data["median_step_ms"] > 0
    ref = json.loads(invoke("run", *program).stdout)["results"]
    assert [row["name"] for row in data["results"]] == [row["name"] for row in ref] == ["out"]
    assert data["results"][0]["finite"] and abs(data["results"][0]["mean"] - ref[0]["mean"]) < 1e-2
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(0, "compute"), (0, "comm"), (1, "compute"), (1, "comm")} <= tracks
    assert any(e["ph"] == "X" and e["args"].get("chunk") == 1 for e in events)
    assert spawned == [(2, "auto", "cpu", 60.0)]


def test_show_code_prints_the_generated_step_of_a_rank():
    r = invoke("show", ROOT / "examples/adam.py:adam", "-s", "N=10", "--schedule", "fuse(RS-C-AG)@ring",
               "--code", "--rank", 1, "--world-size", 3)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith('"""cocoweave plan `fuse(RS-C-AG)@ring`') and "for rank 1 of 3" in r.stdout
    assert "def step(ctx, I):" in r.stdout and "ctx.fused_ring(" in r.stdout
    compile(r.stdout, "step.py", "exec")  # it is Python
    r = invoke("show", ROOT / "examples/adam.py:adam", "-s", "N=10", "--schedule", "AR-C", "--code", "--triton")
    assert r.exit_code == 0, r.output
    assert "ctx.fused(1)(" in r.stdout and "# ---- Triton kernel of stage 1 ----" in r.stdout


def test_bad_torch_options_are_one_line_and_exit_2():
    r = invoke("run", ROOT / "examples/adam.py:adam", "--backend", "torch", "--device", "tpu")
    assert r.exit_code == 2 and "'tpu' is not one of 'cpu', 'cuda'" in " ".join(r.output.replace("│", " ").split())
    r = invoke("run", ROOT / "examples/adam.py:adam", "--iters", 3)
    assert r.exit_code == 2 and "need --backend torch" in r.output
    r = invoke("show", ROOT / "examples/pipeline_parallel.py:boundary", "--code", "-n", 3)
    assert r.exit_code == 2 and "cannot be split into 2 equal pipeline stages" in r.output
    r = invoke("show", ROOT / "examples/adam.py:adam", "--code", "--rank", 5, "-n", 2)
    assert r.exit_code == 2 and "--rank 5 is not a rank" in r.output


def test_tune_keeps_its_measurements_when_the_cache_cannot_be_written(spawned, tmp_path):
    from cocoweave.perf.store import MeasurementStore

    cache = tmp_path / "cache-is-a-folder"
    cache.mkdir()
    r = invoke("tune", ROOT / "examples/adam.py:adam", "-s", "N=16", "-n", 2, "--iters", 1, "--warmup", 0,
               "--rounds", 1, "--store", tmp_path / "store", "--cache", cache, "--timeout", 30)
    assert r.exit_code == 2, r.output
    assert f"cannot write the tuning cache {cache}" in r.stderr and f"the measurements are in the store " \
        f"{tmp_path / 'store'}" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "chose" in r.stdout  # the results were shown
    df = MeasurementStore(tmp_path / "store").load()
    assert len(df) >= 2 and set(df["world_size"]) == {2}
    assert spawned == [(2, "gloo", "cpu", 30.0)]


def test_tune_refuses_a_broken_cache_before_measuring(spawned, tmp_path):
    cache = tmp_path / "cache.json"
    cache.write_bytes(b"\xff not text")
    r = invoke("tune", ROOT / "examples/adam.py:adam", "-s", "N=16", "-n", 2, "--cache", cache)
    assert r.exit_code == 2 and "is not UTF-8 text" in r.stderr, r.output
    assert spawned == []


def test_measure_writes_its_rows_as_json_and_records_them(spawned, tmp_path):
    from cocoweave.perf.store import MeasurementStore

    r = invoke("measure", ROOT / "examples/adam.py:adam", "-s", "N=16", "-n", "1,2", "--schedule", "AR-c",
               "--schedule", "RS-C-AG", "--iters", 1, "--warmup", 0, "--rounds", 1, "--store", tmp_path / "store",
               "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # only the JSON: no table
    assert [(row["world_size"], row["schedule"]) for row in doc["rows"]] == \
        [(1, "AR-c"), (1, "RS-C-AG"), (2, "AR-c"), (2, "RS-C-AG")]
    assert all(row["measured_ms"] > 0 for row in doc["rows"])
    assert len(MeasurementStore(tmp_path / "store").load()) == 4
    assert spawned == [(1, "gloo", "cpu", 60.0), (2, "gloo", "cpu", 60.0)]
