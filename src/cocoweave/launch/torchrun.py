"""Entry points for ranks a launcher started (torchrun, or SLURM with MASTER_ADDR and MASTER_PORT): join the
default process group, leave it cleanly, and turn what a rank raised into one sentence."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .. import faults
from ..backends.torch.placement import group_backend
from ..errors import BackendError
from ..rankenv import RankEnv, missing_to_join
from .failures import _first_line, _is_comm_failure, _raise
from .network import _is_loopback, _use_loopback_for_gloo, listening_store
from .ranks import _RANK, check_seconds


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
    if chosen == "gloo" and local_size == world_size \
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
