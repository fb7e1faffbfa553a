"""The rank process a LocalWorld starts: forked from a server that imported torch once (or spawned), it joins
the group, then runs what the parent sends until told to stop."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from .. import faults, settings
from ..backends.torch.placement import group_backend
from ..rankenv import adopt_environment
from .failures import _describe
from .lifetime import die_with_parent
from .network import _use_loopback_for_gloo
from .ranks import _RANK
from .sending import _resolve, _send

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
        if backend == "gloo":
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

