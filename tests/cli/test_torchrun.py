"""`cocoweave run --backend torch` as ranks of a torchrun world: healthy runs leave the process group cleanly and
exit 0 every time (torchrun restarts a rank that aborts at exit), and a failing rank makes every rank exit 4 with a
sentence naming itself and the stage it was in. `check --backend torch` runs there too, rank 0 comparing.
scripts/torchrun_repeat.sh repeats the healthy run 50 times."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAM = f"{ROOT / 'examples/adam.py'}:adam"
REPEATS = int(os.environ.get("COCOWEAVE_TORCHRUN_REPEATS", "3"))  # scripts/torchrun_repeat.sh sets 50


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("attempt", range(REPEATS))
def test_a_healthy_torchrun_run_exits_0_and_rank_0_reports(tmp_path, attempt):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "0", "-m", "cocoweave", "run", ADAM, "-s", "N=64", "--backend", "torch", "--json", "-"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr
    doc = json.loads(proc.stdout)  # rank 0 alone prints
    assert doc["world_size"] == 2 and doc["where"] == "torch, gloo on cpu, torchrun"
    assert all(row["finite"] for row in doc["results"])


def test_check_under_torchrun_compares_every_schedule_on_rank_0(tmp_path):
    """`check --backend torch` as the ranks of a torchrun world: each runs every schedule on its part of the same
    inputs, rank 0 compares the gathered results with the unscheduled program and alone reports."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "0", "-m", "cocoweave", "check", ADAM, "-s", "N=64", "--backend", "torch", "--json", "-"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    schedules = subprocess.run([sys.executable, "-m", "cocoweave", "schedules", ADAM, "-s", "N=64", "--json", "-"],
                               env=_env(), capture_output=True, text=True, timeout=120)
    names = {row["name"] for row in json.loads(schedules.stdout)}
    assert doc["ok"] and doc["backend"] == "torch" and {r["world_size"] for r in doc["rows"]} == {2}
    assert {r["schedule"] for r in doc["rows"]} == names and len(names) > 10


def _ranks(fault: str, *args: str) -> list[subprocess.CompletedProcess]:
    """Two ranks started with torchrun's environment (no agent), `fault` armed; their finished processes."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "cocoweave", "run", ADAM, "-s", "N=64", "--backend", "torch",
                               *args], env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                COCOWEAVE_FAULT=fault),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            p.kill()
    return out


def test_a_failing_rank_makes_every_rank_exit_4_naming_itself_and_its_stage():
    rank0, rank1 = _ranks("rank=1,stage=0,action=raise", "--timeout", "20")
    assert rank1.returncode == 4 and rank1.stderr.splitlines()[-1] == (
        "error: rank 1 failed at stage 0 (AR): InjectedFault: injected fault on rank 1 at stage 0 (AR)"), rank1.stderr
    assert rank0.returncode == 4, rank0.stderr
    assert rank0.stderr.startswith("error: rank 0 at stage 0 (AR): another rank failed or stopped answering ("), \
        rank0.stderr
    assert rank0.stderr.count("\n") == 1 and "Traceback" not in rank0.stderr + rank1.stderr


def test_a_killed_rank_makes_the_other_exit_4_within_its_timeout():
    rank0, rank1 = _ranks("rank=1,stage=0,action=kill", "--timeout", "20")
    assert rank1.returncode == -9
    assert rank0.returncode == 4 and "error: rank 0 at stage 0 (AR): another rank failed" in rank0.stderr, \
        rank0.stderr


def test_the_wall_timeout_ends_a_hung_rank_with_exit_4():
    rank0, rank1 = _ranks("rank=1,stage=0,action=sleep,seconds=60", "--timeout", "30", "--wall-timeout", "3")
    for rank, proc in ((0, rank0), (1, rank1)):
        assert proc.returncode == 4, proc.stderr
        assert f"error: rank {rank} did not finish within the wall timeout of 3 s (at stage 0 (AR))" in proc.stderr
