"""benchmarks/tp_step.py's plumbing: `--quick` times every variant on a tiny model at tp 2 and writes its JSON."""

import contextlib
import json
from pathlib import Path

from cocoweave import launch
from cocoweave.ir.loader import import_module_file

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tp_step.py"


def test_tp_step_quick_times_every_variant_doing_the_same_work(tmp_path: Path, local_world, monkeypatch) -> None:
    """Its main() as the command line calls it, on the session's world of 2 ranks (not a world of its own)."""
    bench = import_module_file("cocoweave_benchmark_tp_step", str(SCRIPT))
    monkeypatch.setattr(launch, "LocalWorld", lambda ws, **_: contextlib.nullcontext(local_world(ws)))
    assert bench.main(["--quick", "--schedules", "as-written,auto", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("tp_step-*.json")).read_text())
    assert {"cpu", "torch", "cocoweave", "date", "load_average"} <= doc["machine"].keys()
    rows = {r["variant"]: r for r in doc["rows"]}
    assert {"megatron", "torch-tp", "torch-tp-sp", "floor", "floor-sync"} <= rows.keys()
    assert any(v.startswith("cocoweave") for v in rows)
    for v, r in rows.items():
        assert r["median_ms"] > 0 and r["held_bytes"] > 0 and r["ratio_to_floor"] > 0
        assert (r["same_work_rel_diff"] is None) == (v in ("floor", "floor-sync"))
        assert v in ("floor", "floor-sync") or r["same_work_rel_diff"] < 1e-4  # every peer computes the same step
    assert rows["floor"]["comm_share"] == rows["floor-sync"]["comm_share"] == 0 and rows["megatron"]["comm_share"] > 0
    assert rows["floor-sync"]["kind"] == "limit" and rows["floor"]["ratio_to_floor"] == 1.0
    assert min(r["ratio_to_fastest_peer"] for r in rows.values() if r["kind"] == "peer") == 1.0
