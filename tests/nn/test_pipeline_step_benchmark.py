"""benchmarks/pipeline_step.py at toy sizes on the session's world of 4: every variant runs under both schedules, the
sliced boundary sends half of what the full sends send, and the bubble is a fraction."""

from __future__ import annotations

from pathlib import Path

from cocoweave.ir.loader import import_module_file

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline_step.py"


def test_pipeline_step_benchmark_runs_and_counts_half_the_bytes(world4) -> None:
    bench = import_module_file("cocoweave_benchmark_pipeline_step", str(SCRIPT))
    cfg = bench.CONFIG | {"d_model": 32, "heads": 4, "seq": 8, "blocks": 2}
    names = ["torch-tp:full", "cocoweave:sliced"]
    per_rank = world4.run(bench.timings, cfg, names, ["gpipe", "1f1b"], 1, 1, 0.1, "as written")
    for schedule in ("gpipe", "1f1b"):
        full, sliced = (max(r[f"{v}/{schedule}"]["bytes"]["forward"] for r in per_rank) for v in names)
        assert full == cfg["batch"] // cfg["microbatches"] * cfg["seq"] * cfg["d_model"] * 4 == 2 * sliced
        for r in per_rank:
            assert len(r[f"cocoweave:sliced/{schedule}"]["times"]) == 1
            assert all(0 < b <= 1 for b in r[f"torch-tp:full/{schedule}"]["busy"])
