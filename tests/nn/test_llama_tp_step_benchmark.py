"""benchmarks/llama_tp_step.py's plumbing: `--quick` times every variant of the Llama step at tp 2, checks each
peer's losses against the single-process model's, and writes its JSON."""

import contextlib
import json
from pathlib import Path

from cocoweave import launch
from cocoweave.ir.loader import import_module_file

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "llama_tp_step.py"


def test_llama_tp_step_quick_times_every_variant_doing_the_same_work(tmp_path: Path, local_world,
                                                                     monkeypatch) -> None:
    bench = import_module_file("cocoweave_benchmark_llama_tp_step", str(SCRIPT))
    monkeypatch.setattr(launch, "LocalWorld", lambda ws, **_: contextlib.nullcontext(local_world(ws)))
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("llama_tp_step-*.json")).read_text())
    assert {"cpu", "torch", "cocoweave", "date", "load_average"} <= doc["machine"].keys()
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rows.keys() == {"cocoweave", "cocoweave-sp", "torch-tp", "torch-tp-sp", "floor"}
    for v, r in rows.items():
        assert r["median_ms"] > 0 and r["first5_ms"] > 0
        assert (r["same_work_abs_diff"] is None) == (v == "floor")
        assert v == "floor" or r["same_work_abs_diff"] < 1e-4  # every variant trains the single-process curve
    assert rows["floor"]["ratio_to_floor"] == 1.0 and rows["cocoweave"]["kind"] == "cocoweave"
    assert min(r["ratio_to_fastest_peer"] for r in rows.values() if r["kind"] == "peer") == 1.0
