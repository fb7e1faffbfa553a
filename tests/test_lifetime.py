"""The ranks cocoweave starts end with the command that started them on every exit path: a command run under a
timeout leaves nothing of its session behind, SIGTERM to the starting process ends its children, and a child with a
parent-death signal dies when its parent is SIGKILLed (no orphan keeps the cores busy)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cocoweave.launch.lifetime import die_with_parent, run_bounded

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_timed_out_command_leaves_no_process_of_its_session(tmp_path):
    pids = tmp_path / "pids"
    script = f"sleep 60 & echo $! > {pids}; sleep 60 & echo $! >> {pids}; wait"  # a launcher and its two ranks
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded(["sh", "-c", script], dict(os.environ), 1.0)
    assert all(_gone(int(p)) for p in pids.read_text().split())


def test_a_command_that_ends_leaves_no_process_of_its_session_behind(tmp_path):
    """A worker that hangs after the command's last step (a rank's data loader, its output not kept open) does not
    outlive the command (`cocoweave profile` runs torchrun this way)."""
    pids = tmp_path / "pids"
    done = run_bounded(["sh", "-c", f"sleep 60 >/dev/null 2>&1 & echo $! > {pids}; exit 0"], dict(os.environ), 30.0)
    assert done.returncode == 0
    assert _gone(int(pids.read_text()))


CHILD = """
import subprocess, sys, time
sys.path.insert(0, {src!r})
from cocoweave.launch.lifetime import run_bounded
try:
    run_bounded(["sh", "-c", "sleep 60 & echo $! > {pids}; wait"], {{}}, 60)
except SystemExit as e:
    print("exit", e.code, flush=True)
"""


def test_sigterm_to_the_starting_command_ends_the_ranks(tmp_path):
    pids, src = tmp_path / "pids", str(Path(__file__).resolve().parents[1] / "src")
    parent = subprocess.Popen([sys.executable, "-c", CHILD.format(src=src, pids=pids)], stdout=subprocess.PIPE,
                              text=True)
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    out, _ = parent.communicate(timeout=30)
    assert "exit 143" in out  # SIGTERM became SystemExit: the `finally` that ends the ranks ran
    assert _gone(int(pids.read_text()))


ORPHAN = """
import os, signal, subprocess, sys, time
sys.path.insert(0, {src!r})
from cocoweave.launch.lifetime import with_parent_death
child = subprocess.Popen(with_parent_death(["sleep", "60"], signal.SIGKILL))
time.sleep(1)  # the wrapper has set the signal and become `sleep`
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the parent dies without any cleanup
"""


def test_a_child_with_a_parent_death_signal_dies_with_its_parent():
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", ORPHAN.format(src=src)], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL
    assert _gone(int(out.stdout.split()[0]))
    assert die_with_parent(signal.SIGKILL, os.getppid())  # available here, and this process's parent lives
    die_with_parent(0)  # undo: pytest's own parent-death behaviour stays as it was
