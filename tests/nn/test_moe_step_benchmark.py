"""benchmarks/moe_step.py's plumbing: `--quick` times every variant of the MoE step at ep 2, checks each variant's
losses against the single-process model's, and writes its JSON (torchtitan's variant only where it is installed)."""

import contextlib
import importlib.util
import json
from pathlib import Path

from cocoweave import launch
from cocoweave.ir.loader import import_module_file

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_step.py"


def test_moe_step_quick_times_every_variant_doing_the_same_work(tmp_path: Path, local_world, monkeypatch) -> None:
    bench = import_module_file("cocoweave_benchmark_moe_step", str(SCRIPT))
    monkeypatch.setattr(launch, "LocalWorld", lambda ws, **_: contextlib.nullcontext(local_world(ws)))
    titan = importlib.util.find_spec("torchtitan") is not None
    variants = "cocoweave,cocoweave-gloo,cocoweave-program,megatron,floor" + (",torchtitan" if titan else "")
    assert bench.main(["--quick", "--variants", variants, "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("moe_step-*.json")).read_text())
    assert {"cpu", "torch", "cocoweave", "date", "load_average"} <= doc["machine"].keys()
    for model in ("mixtral", "deepseek"):
        rows = {r["variant"]: r for r in doc["rows"] if r["model"] == model}
        assert rows.keys() == set(variants.split(","))
        for v, r in rows.items():
            assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and r["saved_mb"] > 0 and r["cpu_ms"] > 0
            assert (r["same_work_abs_diff"] is None) == (v == "floor")
            assert (r["a2a_mb"] > 0) == (v != "floor")
            # every fp32 variant trains the single-process curve; torchtitan's experts run in bfloat16
            assert v == "floor" or r["same_work_abs_diff"] < (1e-2 if v == "torchtitan" else 1e-4)
        assert rows["floor"]["ratio_to_floor"] == 1.0 and rows["megatron"]["ratio_to_fastest_peer"] == 1.0
        assert rows["cocoweave"]["paired_cocoweave_over"] == 1.0 and rows["floor"]["paired_cocoweave_over"] > 0
