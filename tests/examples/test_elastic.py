"""Elastic training under torchrun (how revocable machines are survived): examples/train_gpt.py with one rank
killed by SIGKILL mid-run restarts, resumes from its last complete checkpoint and logs every step exactly once,
with the losses of an uninterrupted run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS, EVERY, KILL_AT = 12, 4, 9


def _train_gpt():
    """examples/train_gpt.py as a module (its module-level functions can be sent to ranks)."""
    module = sys.modules.get("train_gpt")
    if module is None:
        spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_gpt"] = module
        spec.loader.exec_module(module)
    return module


def _log(path: Path) -> tuple[list[int], list[float], list[str]]:
    steps, losses, notes = [], [], []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            notes.append(line)
        else:
            step, loss = line.split()
            steps.append(int(step))
            losses.append(float(loss))
    return steps, losses, notes


def test_a_rank_killed_mid_run_restarts_from_the_last_checkpoint_without_lost_or_repeated_steps(
        tmp_path, local_world):
    marker, ckpt, log = tmp_path / "killed-once", tmp_path / "ckpt", tmp_path / "steps.log"
    env = dict(os.environ, COCOWEAVE_FAULT=f"rank=1,stage={KILL_AT},label=train_step,action=kill,once={marker}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", "--nproc-per-node=2", "--max-restarts=2",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(SCRIPT), "--steps", str(STEPS),
           "--tensor-parallel", "2", "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--log-file", str(log),
           "--out", str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert f"injected fault: rank 1 kill at stage {KILL_AT} (train_step)" in output and marker.exists()

    steps, losses, notes = _log(log)
    assert steps == list(range(STEPS)), steps  # every step exactly once
    resumed_at = KILL_AT // EVERY * EVERY
    assert notes == [f"# resumed at step {resumed_at}"]
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]

    gpt = _train_gpt()
    cfg = gpt.Config(steps=STEPS, tensor_parallel=2, world_size=2)
    uninterrupted = local_world(2).run(gpt.train_parallel, asdict(cfg))[0]["losses"]
    assert losses == uninterrupted
