"""The benchmark script's plumbing: `--smoke` runs every check and timing path on tiny CPU inputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--smoke"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "kernels.json").read_text())
    names = " ".join(c["name"] for c in results["checks"])
    for kernel in ("adamw flat", "adamw multi", "sgd momentum multi", "lamb multi", "epilogue bfloat16"):
        assert kernel in names
    assert all(c["ok"] for c in results["checks"]) and not results["errors"]
    assert {"device", "torch", "triton", "date"} <= results["env"].keys()
    timed = [t for t in results["timings"] if t["name"].endswith("triton")]
    assert len(timed) == 7 and all(t["ms"] > 0 and t["floor_ms"] > 0 for t in timed)
