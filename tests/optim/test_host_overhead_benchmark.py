"""benchmarks/host_overhead.py's plumbing: `--quick` times every variant's phases at 1 and 2 ranks and counts its
Python calls and aten ops, and writes its JSON."""

import contextlib
import json
from pathlib import Path

from cocoweave import launch
from cocoweave.ir.loader import import_module_file

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"


def test_host_overhead_quick_times_and_counts_every_variant(tmp_path: Path, local_world, monkeypatch) -> None:
    bench = import_module_file("cocoweave_benchmark_host_overhead", str(SCRIPT))
    monkeypatch.setattr(launch, "LocalWorld", lambda ws, **_: contextlib.nullcontext(local_world(ws)))
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("host_overhead-*.json")).read_text())
    assert {"cpu", "torch", "cocoweave", "date", "load_average"} <= doc["machine"].keys()
    assert {(r["world"], r["variant"]) for r in doc["rows"]} == {(w, v) for w in (1, 2) for v in bench.VARIANTS}
    for r in doc["rows"]:
        assert r["total_ms"] >= max(r[f"{p}_ms"] for p in bench.PHASES) > 0
        assert r["python_calls"] > 0 and r["leaf_aten_ops"] > 0
        assert r["variant"] != "ddp-fused" or r["ratio_to_ddp_fused"] == 1.0  # the baseline of the ratios
