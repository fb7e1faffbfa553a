"""Process runtime: a local world of live worker ranks over torch.distributed, and torchrun entry points.

    with LocalWorld(4) as world:                      # 4 rank processes, Gloo on 127.0.0.1, kept alive
        sums = world.run(step, tensor)                # step(rank, world_size, tensor) on every rank

Timeouts: `timeout_s` is how long a rank may wait for the others: the process group's timeout (every
collective) and how long the parent waits for the last ranks once one has finished or failed;
`wall_timeout_s` (default none) caps a whole call. A failing rank, a dead rank or a hang becomes a
`BackendError` naming the ranks (the one that stopped answering first), and the stage each was in; a world
whose ranks died or hung is torn down and marked broken until `restart()`. Every listening socket (the
parent's store, Gloo's pairs) is bound to 127.0.0.1. Functions sent to ranks must be module-level (ranks
import them by module name, or from their file).
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import cloudpickle
import torch
import torch.distributed as dist

from . import faults, settings
from .backends.torch.placement import group_backend
from .errors import BackendError
from .lifetime import die_with_parent
from .loader import import_module_file
from .rankenv import RankEnv, adopt_environment, cores, environment, missing_to_join
from .rankenv import in_torchrun as in_torchrun  # re-exported: examples and the CLI ask launch
from .rankenv import torchrun_device as torchrun_device

log = logging.getLogger(__name__)

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer waits are a mistake (and overflow some timers)
MAX_RANKS_ENV = settings.MAX_LOCAL_RANKS.name
_ERROR_GRACE_S = 2.0  # after a rank raises, how long the others may take to finish before teardown
_EXIT_GRACE_S = 0.25  # after a rank exits, how long to gather other exits before tearing down
_CLOSE_WAIT_S = 5.0
_CPP_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_COMM_FAILURE = re.compile(r"gloo|nccl|pair closure|closed by peer|timed out waiting|connection reset", re.I)

# Per-process state of a rank started by LocalWorld or init_from_env.
_RANK: dict[str, Any] = {}
_RANK_STATE: dict[str, Any] = {}


# ---------------------------------------------------------------------------------------------------------
# Helpers usable inside rank functions
# ---------------------------------------------------------------------------------------------------------


def rank_device() -> torch.device:
    """The device of this rank (cuda:i or cpu); cpu outside a rank."""
    return _RANK.get("device", torch.device("cpu"))


def rank_state() -> dict[str, Any]:
    """A dict private to this rank process that persists across `run` calls (caches, compiled steps)."""
    return _RANK_STATE


def check_seconds(value: float, what: str) -> float:
    """`value` as a float if it is a finite positive number of seconds up to a week, else BackendError."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise BackendError(f"{what} must be a number of seconds, got {value!r}") from None
    if not (0 < seconds <= MAX_TIMEOUT_S):  # also refuses NaN
        raise BackendError(f"{what} must be a finite number of seconds above 0 and at most {MAX_TIMEOUT_S:g} "
                           f"(a week), got {value!r}")
    return seconds


def max_local_ranks() -> int:
    """How many ranks a LocalWorld may start: $COCOWEAVE_MAX_LOCAL_RANKS, else 4 per core and at least 16."""
    return settings.MAX_LOCAL_RANKS.get() or max(16, 4 * cores())


def check_local_ranks(world_size: int) -> int:
    """`world_size` if a LocalWorld may start that many ranks here, else BackendError with a sentence."""
    if world_size < 1:
        raise BackendError(f"a local world needs at least one rank, got world_size={world_size}")
    if world_size > max_local_ranks():
        raise BackendError(f"a local world of {world_size} ranks is more than this machine should start "
                           f"(at most {max_local_ranks()}: 4 per core, at least 16; set {MAX_RANKS_ENV} "
                           "to allow more)")
    return world_size


def listening_store(host: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A master TCPStore whose socket listens on `host` only (torch's own binds every interface)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(256)
        bound = sock.getsockname()[1]
        return dist.TCPStore(host, bound, world_size, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())
    finally:
        sock.close()  # a no-op once detached


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(i[4][0].startswith("127.") or i[4][0] == "::1" for i in infos)


# ---------------------------------------------------------------------------------------------------------
# torchrun entry points
# ---------------------------------------------------------------------------------------------------------


def init_from_env(timeout_s: float = 60.0, backend: str | None = None) -> tuple[int, int, torch.device]:
    """Initialise the default process group from the launcher's env vars (torchrun's, or SLURM's with MASTER_ADDR
    and MASTER_PORT exported: see `cocoweave.rankenv`); returns (rank, world_size, device).

    Gloo on CPU; on CUDA, NCCL with one GPU per local rank, or Gloo with CUDA tensors if ranks share GPUs."""
    missing = missing_to_join()
    if missing:
        raise BackendError(f"init_from_env needs {', '.join(missing)} in the environment; "
                           "start the program with torchrun (under srun, export MASTER_ADDR and MASTER_PORT)")
    env = RankEnv.from_env()
    rank, world_size, local_size = env.rank, env.world_size, env.local_world_size
    device, chosen = env.device(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout_s = check_seconds(timeout_s, "timeout_s")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    host = env.master_addr or ""
    if chosen == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and local_size == world_size \
            and _is_loopback(host):
        _use_loopback_for_gloo()  # the whole world on this host, met at a loopback address: Gloo stays there too
    try:
        store = _rank_store(rank, world_size, timeout_s, env)
        dist.init_process_group(group_backend(chosen), store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=device if chosen == "nccl" else None)  # NCCL: eager init on this GPU
    except Exception as exc:  # noqa: BLE001 - every init failure becomes one sentence
        _raise(f"rank {rank} could not join the process group at {host}:{env.master_port}: "
               f"{type(exc).__name__}: {_first_line(exc)}", ranks=[rank])
    _RANK.update(rank=rank, world_size=world_size, device=device, backend=chosen)
    faults.track(faults.Progress(-1))  # record the stage this rank is in, for error messages
    return rank, world_size, device


def shutdown() -> None:
    """End this rank's part in the default process group cleanly: wait for the other ranks (and this rank's
    pending collectives), then destroy the group. Call it on every rank before a torchrun worker exits:
    a process that exits with a live Gloo group can abort ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def rank_failure(exc: BaseException, rank: int | None = None) -> BackendError:
    """The BackendError for `exc` raised on this torchrun rank: one sentence naming the rank, the stage of a
    generated step it was in, and whether another rank failed (the process group broke) or this one did."""
    rank = _RANK.get("rank", 0) if rank is None else rank
    stage = faults.current_stage()
    at = f" at {faults.where(*stage)}" if stage else ""
    if _is_comm_failure(exc):
        message = f"rank {rank}{at}: another rank failed or stopped answering ({type(exc).__name__}: " \
                  f"{_first_line(exc) or type(exc).__name__})"
    else:
        message = f"rank {rank} failed{at}: {type(exc).__name__}: {_first_line(exc) or type(exc).__name__}"
    err = BackendError(message)
    err.ranks = [rank]  # type: ignore[attr-defined]
    return err


def _rank_store(rank: int, world_size: int, timeout_s: float, env: RankEnv) -> dist.Store:
    """The store of the process group: under torchrun's agent store, a prefix of it private to this restart
    attempt; otherwise rank 0 serves one on MASTER_ADDR:MASTER_PORT (bound to that address only).

    torchrun's agent TCPStore outlives a restart (torch 2.13, c10d rendezvous): keys the killed workers
    wrote are still there for the restarted ones, which then may read stale process-group keys (restarts
    that failed to connect or hung were seen without this prefix); the prefix keeps attempts apart."""
    host, port = env.master_addr or "", env.master_port or 0
    if env.agent_store:
        attempt = env.restart_count
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        return dist.PrefixStore(f"cocoweave/attempt-{attempt}", store)
    if rank == 0:
        return listening_store(host, port, timeout_s, world_size)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


# ---------------------------------------------------------------------------------------------------------
# Sending functions and values to ranks
# ---------------------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without the C++ source location Gloo and NCCL put first."""
    text = str(exc).strip()
    return _CPP_LOCATION.sub("", text.splitlines()[0]) if text else ""


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` comes from the process group itself (after which Gloo and NCCL groups are unusable)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc)))


def _fn_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, functools.partial):
        return _fn_name(fn.func)
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _fn_spec(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """How a rank finds `fn`: by module, qualified name and file (plain functions); lambdas, nested functions and
    functions of a module without a file (a notebook's) by value with cloudpickle; anything else pickled."""
    if not callable(fn):
        raise BackendError(f"world.run needs a callable, got {type(fn).__name__}")
    if isinstance(fn, functools.partial):
        return ("partial", _fn_spec(fn.func), fn.args, fn.keywords)
    qualname = getattr(fn, "__qualname__", "")
    if hasattr(fn, "__code__") and hasattr(fn, "__module__"):
        path = getattr(sys.modules.get(fn.__module__), "__file__", None)
        if "<" in qualname or path is None:  # <lambda>, <locals>, a notebook's function: ranks cannot import it
            try:
                return ("cloudpickle", cloudpickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:  # noqa: BLE001 - whatever its closure holds
                raise BackendError(f"`{qualname}` cannot be sent to ranks: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from None
        return ("ref", fn.__module__, qualname, path)
    return ("value", fn)


def _resolve(spec: tuple[Any, ...]) -> Callable[..., Any]:
    """The function a `_fn_spec` names, imported in this rank."""
    if spec[0] == "value":
        return spec[1]
    if spec[0] == "cloudpickle":
        return pickle.loads(spec[1])
    if spec[0] == "partial":
        return functools.partial(_resolve(spec[1]), *spec[2], **spec[3])
    _, module_name, qualname, path = spec
    try:
        obj: Any = import_module_file(module_name, path)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001
        raise BackendError(f"cannot find `{qualname}` in module {module_name} ({type(exc).__name__}: "
                           f"{_first_line(exc)}); functions sent to ranks must be module-level in a file"
                           ) from None
    return obj


def _describe(exc: BaseException, context: str = "") -> dict[str, Any]:
    """A picklable description of an exception raised in a rank (the exception itself as bytes, if it can)."""
    try:
        original: bytes | None = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
        original = None
    summary = f"{type(exc).__name__}: {_first_line(exc) or type(exc).__name__}"
    return {"summary": f"{context}: {summary}" if context else summary, "comm": _is_comm_failure(exc),
            "traceback": "".join(traceback.format_exception(exc)), "exception": original}


def _undescribe(pickled: bytes | None) -> BaseException | None:
    """The exception a rank raised, where this process can unpickle it."""
    try:
        return pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - e.g. its class lives in a module only the rank can import
        return None


# ---------------------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------------------


def _use_loopback_for_gloo() -> None:
    """Make Gloo's pairs listen on the loopback interface (ranks on one host)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return
    ifname = next((n for n in ("lo", "lo0") if n in names), None)
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname


def _send(conn: Connection, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


# What a rank imports before it can join a group: ranks fork from a server that imported it once per process,
# instead of each spawned rank importing torch again (seconds per rank, minutes on a loaded host).
_PRELOAD = ["torch", "torch.distributed", "cocoweave.launch"]


@functools.cache
def _fork_server(wait_s: float) -> bool:
    """Start the fork server with torch preloaded, once per process; whether it answered within `wait_s`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    probe = ctx.Process(target=os.getpid, name="cocoweave-fork-server-probe", daemon=True)
    probe.start()
    probe.join(wait_s)
    return probe.exitcode == 0


def _rank_context(wait_s: float) -> Any:
    """The multiprocessing context ranks start in: a fork server with torch preloaded where the platform has one
    (Linux, macOS), else spawn. Both start ranks from a clean process: no thread, lock or CUDA state of the caller's.
    The first call waits (up to `wait_s`) for the server's imports, so they do not count against a world's start."""
    if "forkserver" not in mp.get_all_start_methods() or settings.SPAWN_RANKS.get():
        return mp.get_context("spawn")
    _fork_server(wait_s)
    return mp.get_context("forkserver")


def _worker_main(rank: int, world_size: int, port: int, backend: str, device: str, timeout_s: float,
                 start_timeout_s: float, threads: int, conn: Connection, progress: Any = None,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    """Body of one rank process: join the group, then run what the parent sends until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and tears the world down
    # The rank ends with the process that started it, however that ends (SIGKILL, SIGTERM): no orphan. Forked from
    # the fork server, its OS parent is the server, which exits as soon as the starting process is gone.
    die_with_parent(signal.SIGKILL, os.getppid())
    if env is not None and adopt_environment(env):  # the starter's environment now, not the fork server's
        faults.configure_from_env()
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError:
            pass
    try:
        torch.set_num_threads(threads)
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            _use_loopback_for_gloo()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=start_timeout_s))
        # Wait until every rank has started (imports are slow): the group's timeout then covers only work.
        if store.add("started", 1) == world_size:
            store.set("all_started", "1")
        store.wait(["all_started"], timedelta(seconds=start_timeout_s))
        dist.init_process_group(group_backend(backend), store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if backend == "nccl" else None)  # NCCL: eager init on this GPU
        _RANK.update(rank=rank, world_size=world_size, device=dev, backend=backend)
        faults.track(progress)  # the stage this rank is in, for the parent's error messages
    except BaseException as exc:  # noqa: BLE001
        _send(conn, ("start_error", 0, _describe(exc)))
        return
    _send(conn, ("ready", 0, os.getpid()))
    while True:
        try:
            kind, seq, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent is gone
            break
        if kind == "close":
            break
        try:
            faults.reset_stage()
            spec, args, kwargs = pickle.loads(payload)
            result = _resolve(spec)(rank, world_size, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes back to the caller
            stage = faults.current_stage()
            reply = pickle.dumps(("error", seq, _describe(exc, f"at {faults.where(*stage)}" if stage else "")),
                                 protocol=pickle.HIGHEST_PROTOCOL)
        else:
            try:
                reply = pickle.dumps(("ok", seq, result), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001
                reply = pickle.dumps(("error", seq, _describe(exc, "its result cannot be pickled")),
                                     protocol=pickle.HIGHEST_PROTOCOL)
        faults.reset_stage()  # idle: a rank stopped between runs is at no stage
        try:
            conn.send_bytes(reply)
        except (EOFError, OSError):
            break
    code = 0
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        code = 1
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (seconds with torch loaded); nothing is left to clean up


# ---------------------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------------------


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


def _raise(message: str, **attrs: Any) -> NoReturn:
    err = BackendError(message)
    for key, value in attrs.items():
        setattr(err, key, value)
    raise err


class LocalWorld:
    """`world_size` live rank processes on this machine in one process group; `run` sends them work. The ranks end
    with the process that made the world, however it ends (a parent-death signal, cocoweave.lifetime). They fork from
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
