"""A multi-node-style run on one host: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) of two
ranks each train examples/train_gpt.py data-parallel x tensor-parallel; both agents exit 0 and the losses equal
the one-process reference. scripts/multinode_train_gpt.sh runs the same at 200 steps."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"


def test_two_torchrun_agents_on_one_host_train_gpt_like_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"multinode-{port}",
           "--max-restarts", "0", str(SCRIPT), "--steps", "4", "--tensor-parallel", "2", "--out", str(tmp_path)]
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    for a, out in zip(agents, outputs):
        assert a.returncode == 0, out[-3000:]
    report = next(out for out in outputs if "dp 2 x tp 2, 4 steps" in out)
    assert "max |difference|" in report
    result = json.loads((tmp_path / "losses.json").read_text())
    assert len(result["parallel"]) == 4 and result["max_abs_diff"] < 1e-3
