"""The shared-memory segments are safe as the library collectives they replace: anonymous (nothing in /dev/shm,
whatever kills a rank), mode 0600 whatever the umask, opened only after owner, mode and size are checked, their
space reserved when they are made (no space: the library's collective, with a warning, on every rank alike), and a
rank SIGKILLed before it maps a segment another rank made leaves nothing behind and is named at once."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch import shm
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.equivalence.compare import compare_results
from cocoweave.errors import BackendError
from cocoweave.schedule.enumerate import _on
from cocoweave.schedule.schedule import Schedule


def _in_dev_shm() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir()) if Path("/dev/shm").is_dir() else []


def test_a_segment_is_0600_whatever_the_umask_and_has_no_name(monkeypatch):
    before = _in_dev_shm()
    old = os.umask(0)
    try:
        fd = shm.create(4096)
    finally:
        os.umask(old)
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o600
        assert _in_dev_shm() == before  # nothing anybody could open by name
        mine = shm.open_peer(os.getpid(), fd, 4096)  # how a peer opens it: through /proc, checked
        os.close(mine)
        with pytest.raises(BackendError, match=r"is not a shared-memory segment of this user .* expected uid \d+, "
                                               r"600, 8192\): refusing to map it"):
            shm.open_peer(os.getpid(), fd, 8192)  # another size than agreed
        monkeypatch.setattr(shm.os, "geteuid", lambda: os.fstat(fd).st_uid + 1)
        with pytest.raises(BackendError, match="is not a shared-memory segment of this user"):
            shm.open_peer(os.getpid(), fd, 4096)  # another user's
    finally:
        os.close(fd)


def test_no_space_is_found_when_the_segment_is_made(monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    with pytest.raises(shm.ShmUnavailable, match=r"could not reserve 4096 bytes of shared memory \(No space left on "
                                                 r"device\)"):
        shm.create(4096)


def _collectives() -> cw.Program:
    p = cw.Program("collectives")
    g = p.tensor("g", (6, 2), "float32", cw.Local)
    p.output(cw.all_reduce(g, "sum"), "ar")
    p.output(cw.reduce_scatter(g, "sum", 0), "rs")
    return p


def _on_shm(program: cw.Program) -> Schedule:
    return _on(program, Schedule(program), ("collective",), "shm")  # every collective through shared memory


def _without_space(rank: int, world_size: int, schedule: Schedule, inputs: list) -> tuple:
    real = shm.create

    def full(nbytes: int) -> int:
        raise shm.ShmUnavailable(f"could not reserve {nbytes} bytes of shared memory (No space left on device)")

    shm.create = full  # the segment maker (rank 0) finds no space; rank 1 learns it through the store
    try:
        with pytest.warns(RuntimeWarning, match=r"shm collectives run as the library's: .*No space left"):
            out = run_schedules(rank, world_size, [schedule], inputs, {})
    finally:
        shm.create = real
    return out[0]


def test_no_space_falls_back_to_the_library_on_every_rank(local_world):
    program = _collectives()
    inputs = make_inputs(program, 2, {}, seed=5)
    got = local_world(2).run(_without_space, _on_shm(program), inputs)
    assert compare_results(program, got, reference.run(program, inputs, {}, whole_state=True)).ok


def test_a_rank_killed_at_any_stage_of_a_step_leaves_nothing_and_is_named_at_once():
    """scripts/shm_kill_matrix.py: two forked ranks per stage, rank 1 SIGKILLed there; rank 0 names it within 5 s
    (by its proven PID, not after the 30 s timeout) and /dev/shm holds what it held before."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "shm_kill_matrix.py"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script), "--timeout", "30"], capture_output=True, text=True, env=env,
                         timeout=240)
    cases = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 5 and out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert all(c["left_in_dev_shm"] == [] and c["rank1_exit"] == -signal.SIGKILL for c in cases)
    for c in cases[1:]:
        assert "rank 1 exited while the ranks [0, 1] waited for it in a shared-memory barrier" in c["rank0"]["error"]
        assert c["rank0"]["seconds"] < 5
