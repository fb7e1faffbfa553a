"""LocalWorld, the parent side: `world_size` live rank processes on this machine in one process group, kept
alive across calls; a failing, dead or hung rank becomes a BackendError naming it and its stage."""

from __future__ import annotations

import logging
import math
import multiprocessing.util as mp_util
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import torch

from .. import faults
from ..errors import BackendError
from ..rankenv import cores, environment
from .failures import _first_line, _raise, _undescribe
from .network import listening_store
from .ranks import check_local_ranks, check_seconds
from .sending import _fn_name, _fn_spec, _send
from .worker import _rank_context, _worker_main

log = logging.getLogger(__name__)

_ERROR_GRACE_S = 2.0  # after a rank raises, how long the others may take to finish before teardown
_EXIT_GRACE_S = 0.25  # after a rank exits, how long to gather other exits before tearing down
_CLOSE_WAIT_S = 5.0


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _default_threads(world_size: int) -> int:
    return max(1, cores() // world_size)


def _stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer (Linux; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=_CLOSE_WAIT_S)



class LocalWorld:
    """`world_size` live rank processes on this machine in one process group; `run` sends them work. The ranks end
    with the process that made the world, however it ends (a parent-death signal, launch/lifetime.py). They fork from
    a server that imported torch once (COCOWEAVE_SPAWN_RANKS=1: spawned, each importing it), with the starter's
    environment and folder at the time of the start."""

    def __init__(self, world_size: int, backend: str = "gloo", device: str = "cpu", timeout_s: float = 60.0,
                 threads_per_rank: int | None = None, start_timeout_s: float | None = None,
                 wall_timeout_s: float | None = None) -> None:
        """`timeout_s`: how long a rank may wait for the others (each collective; the parent, for the last
        ranks of a call once one has finished); `wall_timeout_s`: the longest a call may take (default: no
        limit); `start_timeout_s`: the longest starting the ranks may take (default max(120, timeout_s))."""
        check_local_ranks(world_size)
        timeout_s = check_seconds(timeout_s, "timeout_s")
        wall_timeout_s = None if wall_timeout_s is None else check_seconds(wall_timeout_s, "wall_timeout_s")
        start_timeout_s = max(120.0, timeout_s) if start_timeout_s is None else \
            check_seconds(start_timeout_s, "start_timeout_s")
        dev = torch.device(device)
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" and world_size <= torch.cuda.device_count() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise BackendError(f"backend must be gloo, nccl or auto, got {backend!r}")
        if dev.type not in ("cpu", "cuda"):
            raise BackendError(f"device must be cpu or cuda, got {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendError("device cuda was asked for, and no GPU is visible")
        if backend == "nccl":
            if dev.type != "cuda":
                raise BackendError("backend nccl needs device='cuda'")
            if world_size > torch.cuda.device_count():
                raise BackendError(f"backend nccl needs one GPU per rank: {world_size} ranks, "
                                   f"{torch.cuda.device_count()} GPUs; use backend='gloo' to share GPUs")
        self.world_size = world_size
        self.backend = backend
        self.device = dev.type
        self.timeout_s = timeout_s
        self.wall_timeout_s = wall_timeout_s
        self.start_timeout_s = start_timeout_s
        self.threads_per_rank = threads_per_rank or _default_threads(world_size)
        self.broken: str | None = None  # why the world cannot run anything, if it cannot
        self._lock = threading.Lock()
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._progress: list[Any] = []
        self._store: Any = None
        self._seq = 0
        self._finalizer: mp_util.Finalize | None = None
        self.pids: list[int] = []
        self._start()

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        ctx = _rank_context(self.start_timeout_s)
        procs: list[Any] = []
        conns: list[Connection] = []
        self._procs, self._conns = procs, conns
        # Runs at exit before multiprocessing joins its children (which would wait forever on idle ranks).
        self._finalizer = mp_util.Finalize(self, _kill, args=(procs,), exitpriority=10)
        rank = 0
        try:
            self._store = listening_store("127.0.0.1", 0, self.start_timeout_s)
            self._progress = [ctx.RawValue(faults.Progress) for _ in range(self.world_size)]
            for progress in self._progress:
                progress.stage = -1  # no stage entered yet
            env, cwd = environment(), os.getcwd()  # every rank starts with the starter's environment and folder
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                conns.append(parent_end)
                p = ctx.Process(target=_worker_main, name=f"cocoweave-rank-{rank}", daemon=False,
                                args=(rank, self.world_size, self._store.port, self.backend, self.device,
                                      self.timeout_s, self.start_timeout_s, self.threads_per_rank, child_end,
                                      self._progress[rank], env, cwd))
                try:
                    p.start()
                finally:
                    child_end.close()
                procs.append(p)
        except BaseException as exc:  # a process limit, no memory, Ctrl-C: stop the ranks already started
            started = len(procs)
            self._break(f"starting rank {rank} failed")
            if not isinstance(exc, Exception):
                raise
            _raise(f"could not start rank {rank} of a local world of {self.world_size}: {type(exc).__name__}: "
                   f"{_first_line(exc)}; the {started} rank{'' if started == 1 else 's'} already started "
                   f"{'was' if started == 1 else 'were'} stopped", ranks=[rank])
        self.broken = None
        self.pids = self._collect(0, "the start", None, self.start_timeout_s, starting=True)
        log.info("local world of %d ranks started (%s on %s), pids %s", self.world_size, self.backend, self.device,
                 self.pids)

    def restart(self) -> None:
        """Tear the world down (killing ranks if needed) and start fresh ranks with the same settings."""
        with self._lock:
            log.info("restarting the local world of %d ranks%s", self.world_size,
                     f" (it was unusable because {self.broken})" if self.broken else "")
            self._shutdown(graceful=self.broken is None)
            self._start()

    def close(self) -> None:
        """Stop every rank: destroy its process group and join it; ranks that do not stop are killed."""
        with self._lock:
            self._shutdown(graceful=self.broken is None)
            self.broken = "it was closed"

    def _shutdown(self, graceful: bool) -> None:
        if graceful:
            for conn, p in zip(self._conns, self._procs):
                try:
                    if p.is_alive():
                        _send(conn, ("close", 0, None))
                except OSError:
                    pass
            deadline = time.monotonic() + _CLOSE_WAIT_S
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill(self._procs)
        for conn in self._conns:
            conn.close()
        for p in self._procs:
            p.close()
        if self._finalizer is not None:
            self._finalizer.cancel()
        self._procs, self._conns, self._store = [], [], None

    def _break(self, reason: str) -> None:
        """Mark the world broken and kill every rank (survivors may be blocked in collectives)."""
        self.broken = reason
        log.warning("local world of %d ranks stopped: %s", self.world_size, reason)
        self._shutdown(graceful=False)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"broken: {self.broken}" if self.broken else "live"
        return f"LocalWorld({self.world_size}, backend={self.backend!r}, device={self.device!r}, {state})"

    # -- running ---------------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(rank, world_size, *args, **kwargs)` on every rank; returns the per-rank results."""
        return self.call(fn, args, kwargs)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
             timeout_s: float | None = None, wall_timeout_s: float | None = None) -> list[Any]:
        """`run` with an explicit argument tuple and keyword dict; `timeout_s` (how long the parent waits for
        the last ranks once one has finished) and `wall_timeout_s` default to the world's."""
        wait_s = self.timeout_s if timeout_s is None else check_seconds(timeout_s, "timeout_s")
        wall_s = self.wall_timeout_s if wall_timeout_s is None else check_seconds(wall_timeout_s, "wall_timeout_s")
        name = _fn_name(fn)
        with self._lock:
            if self.broken:
                raise BackendError(f"cannot run `{name}`: the local world is unusable because {self.broken}; "
                                   "call restart() or make a new LocalWorld")
            try:
                payload = pickle.dumps((_fn_spec(fn), tuple(args), dict(kwargs or {})),
                                       protocol=pickle.HIGHEST_PROTOCOL)
            except BackendError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise BackendError(f"the arguments of `{name}` cannot be sent to ranks: "
                                   f"{type(exc).__name__}: {_first_line(exc)}") from None
            self._seq += 1
            seq = self._seq
            try:
                message = pickle.dumps(("run", seq, payload), protocol=pickle.HIGHEST_PROTOCOL)
                for conn in self._conns:
                    try:
                        conn.send_bytes(message)
                    except OSError:  # a dead rank: _collect reports it
                        pass
                replies = self._collect(seq, f"`{name}`", wait_s, wall_s)
            except BackendError:
                raise
            except BaseException:  # Ctrl-C, a broken pipe: the ranks' state is unknown
                self._break(f"a run of `{name}` was interrupted")
                raise
            return replies

    def _collect(self, seq: int, label: str, wait_s: float | None, wall_s: float | None,
                 starting: bool = False) -> list[Any]:
        """One reply per rank (`label`: "`fn`" or "the start"), or a BackendError: once a rank has replied,
        the others have `wait_s` more seconds; the whole call has `wall_s` (None: no limits)."""
        during = "the start of the local world" if starting else f"run of {label}"
        n = self.world_size
        results: dict[int, Any] = {}
        errors: dict[int, dict[str, Any]] = {}
        exits: dict[int, int | None] = {}
        start = time.monotonic()
        limit = math.inf if wall_s is None else start + wall_s
        why = "wall"  # which limit is the nearest: "wall", "wait" (after a first reply) or "grace"
        owner: dict[Any, int] = {c: r for r, c in enumerate(self._conns)}
        owner.update({p.sentinel: r for r, p in enumerate(self._procs)})
        pending = set(range(n))

        def sooner(seconds: float, reason: str) -> None:
            nonlocal limit, why
            if time.monotonic() + seconds < limit:
                limit, why = time.monotonic() + seconds, reason

        while pending:
            now = time.monotonic()
            if now >= limit:
                break
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for obj in wait(waitables, timeout=None if limit == math.inf else limit - now):
                r = owner[obj]
                if r not in pending:
                    continue
                conn = self._conns[r]
                try:
                    if obj is not conn and not conn.poll():
                        raise EOFError
                    kind, got_seq, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # the process ended without replying
                    self._procs[r].join(timeout=1.0)
                    exits[r] = self._procs[r].exitcode
                    pending.discard(r)
                    sooner(_EXIT_GRACE_S, "grace")  # gather ranks that died together
                    continue
                except Exception as exc:  # noqa: BLE001 - a result this process cannot unpickle
                    errors[r] = {"summary": f"its result cannot be unpickled here: {type(exc).__name__}: "
                                            f"{_first_line(exc)}", "traceback": traceback.format_exc(),
                                 "exception": None, "comm": False}
                    pending.discard(r)
                    continue
                if got_seq != seq:
                    continue
                pending.discard(r)
                if kind in ("ok", "ready"):
                    results[r] = value
                else:
                    errors[r] = value
                    if not exits:
                        sooner(_ERROR_GRACE_S, "grace")
                if wait_s is not None:
                    sooner(wait_s, "wait")  # the others may take `wait_s` longer than this rank
        if exits:
            self._fail_exits(exits, during)
        if errors:
            self._fail_errors(errors, sorted(pending), during, starting)
        if pending:
            late = sorted(pending)
            at = self._stages(late)
            self._break(f"{_ranks(late)} did not finish {during}")
            what = "did not start" if starting else f"did not finish {label}"
            within = f"{wait_s:g} s" if why == "wait" else f"the wall timeout of {wall_s:g} s"
            if starting:
                within = f"{wall_s:g} s"
            _raise(f"{_ranks(late)} {what} within {within}{at}", ranks=late)
        return [results[r] for r in range(n)]

    def _stages(self, ranks: list[int]) -> str:
        """' (rank 1 at stage 2 (RS), ...)': where the given ranks were in a generated step, if anywhere,
        and which of them are stopped by a signal."""
        parts = []
        for r in ranks:
            at = self._progress[r].describe() if r < len(self._progress) else None
            stopped = r < len(self._procs) and _stopped(self._procs[r].pid)
            if at or stopped:
                parts.append(f"rank {r}" + (f" at {at}" if at else "") + (" is stopped by a signal" if stopped
                                                                             else ""))
        return f" ({', '.join(parts)})" if parts else ""

    def _fail_exits(self, exits: dict[int, int | None], during: str) -> NoReturn:
        dead = sorted(exits)
        codes = [exits[r] for r in dead]
        if None in codes:
            how = "stopped answering"
        elif len(set(codes)) > 1:
            how = "exited with codes " + ", ".join(map(str, codes))
        elif codes[0] is not None and codes[0] < 0:
            how = f"{'was' if len(dead) == 1 else 'were'} killed by {_signal_name(-codes[0])}"
        elif codes[0] == 0:
            how = "exited with code 0 without returning a result"
        else:
            how = f"exited with code {codes[0]}"
        at = self._stages(dead)
        self._break(f"{_ranks(dead)} {how}")
        _raise(f"{_ranks(dead)} {how} during {during}{at}", ranks=dead, exit_codes=exits)

    def _fail_errors(self, errors: dict[int, dict[str, Any]], pending: list[int], during: str,
                     starting: bool) -> NoReturn:
        failed = sorted(errors)
        first = errors[failed[0]]
        comm = any(e["comm"] for e in errors.values())
        extra = dict(remote_traceback=first["traceback"], remote_exception=_undescribe(first["exception"]),
                     remote_tracebacks={r: e["traceback"] for r, e in sorted(errors.items())})
        if pending and all(e["comm"] for e in errors.values()):
            # The failing ranks gave up waiting for the pending ones: name those first.
            msg = f"{_ranks(pending)} stopped answering and did not finish the {during}{self._stages(pending)}; " \
                  f"{_ranks(failed)} gave up waiting: {first['summary']}"
            self._break(f"{_ranks(pending)} stopped answering during {during}")
            _raise(msg, ranks=pending + failed, **extra)
        same = all(e["summary"] == first["summary"] for e in errors.values())
        msg = f"{_ranks(failed if same else failed[:1])} {'failed to start' if starting else 'failed'}: " \
              f"{first['summary']}"
        if not same:
            msg += f" ({_ranks(failed[1:])} failed too)"
        if pending:
            msg += f"; {_ranks(pending)} did not finish{self._stages(pending)} and the world was shut down"
        elif comm:
            msg += "; the process group is unusable after this and the world was shut down"
        if pending or starting or comm:
            self._break(f"{_ranks(failed)} failed during {during}")
        _raise(msg, ranks=failed, **extra)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def spawn_and_run(world_size: int, fn: Callable[..., Any], args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, *, backend: str = "gloo", device: str = "cpu",
                  timeout_s: float = 60.0, threads_per_rank: int | None = None,
                  wall_timeout_s: float | None = None) -> list[Any]:
    """Start a LocalWorld, call `fn(rank, world_size, *args, **kwargs)` on every rank once, close it."""
    with LocalWorld(world_size, backend=backend, device=device, timeout_s=timeout_s,
                    threads_per_rank=threads_per_rank, wall_timeout_s=wall_timeout_s) as world:
        return world.call(fn, args, kwargs)
