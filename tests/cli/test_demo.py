"""`cocoweave demo` on the session's world of 4 ranks at tiny sizes: every schedule of the three workloads is
checked, timed against its baseline and written to the report folder."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from cocoweave.cli import app
from cocoweave.cli.demo import DEFAULT_WORKLOADS, demo_on
from cocoweave.demo.runner import WORKLOADS
from cocoweave.schedule.enumerate import enumerate_schedules


def test_demo_checks_times_and_reports_every_schedule(world4, tmp_path):
    keys = DEFAULT_WORKLOADS.split(",")
    folder, result = demo_on(world4, keys, quick=True, iters=1, warmup=0, out=tmp_path, command="cocoweave demo")
    assert folder.parent == tmp_path and folder.name.startswith("demo-")
    for name in ("report.md", "results.json", "bars.png", "trace.json"):
        assert (folder / name).stat().st_size > 0, name
    assert (folder / "bars.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (folder / "report.md").read_text()
    data = json.loads((folder / "results.json").read_text())
    assert [w["key"] for w in data["workloads"]] == keys
    for key, w in zip(keys, data["workloads"]):
        expected = [s.name for s in enumerate_schedules(WORKLOADS[key].program(WORKLOADS[key].quick_sizes, "cpu"))]
        assert [r["schedule"] for r in w["rows"]] == expected
        assert w["baseline_ms"] > 0
        for r in w["rows"]:
            assert r["reference_ok"] and r["torch_ok"], r
            assert math.isfinite(r["ms"]) and r["ms"] > 0
            assert f"| {r['schedule']} |" in report or f"| **{r['schedule']}** |" in report
        assert f"baseline: {w['baseline']}" in report
        assert [b["name"] for b in w["baselines"]] == [b.name for b in WORKLOADS[key].baselines]
        assert w["baseline_ms"] == min(b["ms"] for b in w["baselines"])  # the strongest baseline
        for b in w["baselines"]:
            assert f"| baseline: {b['name']} |" in report
        sliced_weights = [r for r in w["rows"] if r["gathers"]]
        assert {r["schedule"] for r in sliced_weights} == {r["schedule"] for r in w["rows"]
                                                           if "w" in r["schedule"].partition("+slice(")[2]}
        assert all("timed with its all-gather; not the headline" in report.split(f"| {r['schedule']} |")[1]
                   .split("\n")[0] for r in sliced_weights)
        head = data["headlines"][key]
        assert head["schedule"] not in {r["schedule"] for r in sliced_weights}
        assert head["ms"] == min(r["ms"] for r in w["rows"] if not r["gathers"])
    assert any(w["key"] == "adam" and any(r["gathers"] == ["w"] for r in w["rows"]) for w in data["workloads"])
    rows = sum(len(w["rows"]) for w in data["workloads"])
    assert report.startswith(f"# cocoweave demo\n\nProven: {rows} of {rows} schedules of 3 workloads compute what")
    assert "on 3 random input sets at small sizes on the reference backend" in report
    assert "\nTimed: each schedule and each plain PyTorch baseline" in report and "fresh dropout mask" in report
    trace = json.loads((folder / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"].split()[0] for e in spans} == set(keys)  # the fastest schedule of each workload
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert all(w.fastest is not None for w in result.workloads)


def test_demo_rejects_unknown_workloads_with_one_line():
    out = CliRunner().invoke(app, ["demo", "--workloads", "adam,nope"])
    assert out.exit_code == 2
    assert "unknown workload 'nope'" in out.output and "Traceback" not in out.output
