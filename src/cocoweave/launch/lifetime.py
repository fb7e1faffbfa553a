"""Process lifetime of the ranks cocoweave starts: they end with the command that started them, on every exit path
(a timeout, an error, Ctrl-C, SIGTERM, or the command killed outright), so no orphan keeps the cores busy.

Two means: a parent-death signal (Linux prctl PR_SET_PDEATHSIG: the kernel signals a child when the thread that
started it exits, however it exits; set by the child itself, or for a command line by a small wrapper that then
execs it), and for a command line started here, its own session, which is signalled whole (SIGTERM, then SIGKILL
after a grace period).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

PR_SET_PDEATHSIG = 1
GRACE_S = 15.0  # how long a started command has to end its own children after SIGTERM, before SIGKILL


def _find_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux; False elsewhere). With `parent` (the
    parent's PID before this process started), a parent that already exited ends this process now."""
    if _PRCTL is None or _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:  # the parent exited before prctl: too late for the signal
        os.kill(os.getpid(), sig)
    return True


# Sets the parent-death signal, then becomes the command (execvp keeps it): a small Python process instead of a
# preexec_fn, which is unsafe when the parent has threads (it runs between fork and exec)
_EXEC_WITH_PARENT_DEATH = ("import ctypes, os, sys\n"
                           "ctypes.CDLL(None).prctl(1, int(sys.argv[1]), 0, 0, 0)\n"
                           "if os.getppid() != int(sys.argv[2]):\n    sys.exit(143)\n"
                           "os.execvp(sys.argv[3], sys.argv[3:])")


def with_parent_death(command: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """`command` run so that it gets `sig` when this process exits (Linux; the command itself elsewhere)."""
    if _PRCTL is None:
        return list(command)
    return [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH, str(int(sig)), str(os.getpid()), *command]


def stop(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """End `proc` (started by `run_bounded`, in a session of its own) and everything in its session: SIGTERM, then
    SIGKILL after `grace_s` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143) in the main thread, so that `finally` clauses (ending the
    ranks, removing temporary folders) run; elsewhere (another thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_bounded(command: Sequence[str], env: Mapping[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) that never leaves a process behind: the command gets
    a session of its own and a parent-death signal; on the timeout (subprocess.TimeoutExpired), an error, Ctrl-C or
    SIGTERM, its whole session is ended (`stop`) before this returns or raises, and once it has ended by itself,
    whatever it left running in its session is killed."""
    # SIGTERM on this process's death: a launcher like torchrun then ends its own ranks
    proc = subprocess.Popen(with_parent_death(command), env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        with sigterm_as_exit():
            out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        stop(proc)
        proc.communicate()
        raise
    try:  # the command has ended: what is left of its session (a data-loader worker that hung) is an orphan
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
