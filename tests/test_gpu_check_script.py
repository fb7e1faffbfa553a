"""scripts/gpu_check.sh, the next GPU lease's one call, in its dry mode on this CPU machine: a step runs on the CPU
over Gloo with the smallest sizes and the summary and the step's JSON come back (the whole dry run, every step, is
`GPU_CHECK_DRY=1 scripts/gpu_check.sh`: about 4.5 minutes here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_mode_runs_a_step_and_writes_its_results(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_STEPS": "step-gloo", "OUT": str(tmp_path),
           "PY": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0 and summary["ok"], done.stdout[-3000:] + done.stderr[-3000:]
    assert [s["step"] for s in summary["steps"]] == ["step-gloo"] and "--device cpu" in summary["steps"][0]["command"]
    rows = json.loads((tmp_path / "train_step-gloo.json").read_text())
    assert rows  # the benchmark's own record of what it timed
