"""The rank's environment, read in one place: which process of which world this is, on which node and host, with how
many cores, and which backend and device it takes.

    env = RankEnv.current()   # torch.distributed's rank and world size once initialised, else the launcher's
    env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.cores

Launchers say it in their own variables: LAUNCHERS has one row per launcher (torchrun, SLURM), so supporting another
is one more row. Where several launchers' variables are set, one that marks the workers it started (torchrun sets
TORCHELASTIC_RUN_ID) runs inside the other (torchrun started by srun) and wins; otherwise they must agree, or a
SettingsError names the variables that disagree. The COCOWEAVE_* settings live in `cocoweave.settings`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from . import settings
from .errors import BackendError, SettingsError


@dataclass(frozen=True)
class Launcher:
    """The variables through which a launcher tells each process its place ("" where it has none)."""

    name: str
    rank: str
    world_size: str
    local_rank: str = ""
    local_world_size: str = ""
    node_rank: str = ""
    marker: str = ""  # set only in processes this launcher started itself: it runs inside any other launcher
    tasks_per_node: str = ""  # every node's task count, compressed ("2(x3),1"): the local world size by node rank


LAUNCHERS: tuple[Launcher, ...] = (
    Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"),
    Launcher("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID",
             tasks_per_node="SLURM_TASKS_PER_NODE"),
)
TORCHRUN = LAUNCHERS[0]
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")  # where the ranks meet (torchrun sets them; under srun, export them)
_PLACE = ("rank", "world_size", "local_rank", "local_world_size", "node_rank")
_WHAT = {"rank": "rank", "world_size": "world size", "local_rank": "local rank",
         "local_world_size": "local world size"}


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _whole(env: Mapping[str, str], name: str) -> int | None:
    """The variable `name` as a whole number >= 0, None when unset or empty; SettingsError when malformed."""
    text = env.get(name, "") if name else ""
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise SettingsError(f"{name} must be a whole number of at least 0, got {text!r}")
    return value


Reading = dict[str, tuple[int | None, str]]  # field -> (value, the variable it came from); None: unset


def _reading(launcher: Launcher, env: Mapping[str, str]) -> Reading:
    """What `launcher`'s variables say; the local world size from the per-node task list where it has no variable
    of its own (srun sets SLURM_NTASKS_PER_NODE only when given --ntasks-per-node)."""
    got = {field: (_whole(env, getattr(launcher, field)), getattr(launcher, field)) for field in _PLACE}
    node = got["node_rank"][0]
    if got["local_world_size"][0] is None and node is not None and env.get(launcher.tasks_per_node):
        counts = tasks_per_node(env[launcher.tasks_per_node], launcher.tasks_per_node)
        if node >= len(counts):
            raise SettingsError(f"{launcher.node_rank}={node} names no node of {launcher.tasks_per_node}="
                                f"{env[launcher.tasks_per_node]!r} ({len(counts)} nodes)")
        got["local_world_size"] = (counts[node], launcher.tasks_per_node)
    return got


def tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Each node's task count from SLURM's compressed list: "2(x3),1" -> [2, 2, 2, 1]; SettingsError if malformed."""
    counts: list[int] = []
    for item in text.split(","):
        count, repeated, times = item.strip().partition("(x")
        if not count.isdigit() or (repeated and not (times.endswith(")") and times[:-1].isdigit())):
            raise SettingsError(f"{name} must list task counts like '2(x3),1', got {text!r}")
        counts += [int(count)] * (int(times[:-1]) if repeated else 1)
    return counts


def _resolve(env: Mapping[str, str]) -> tuple[Launcher | None, Reading]:
    """The launcher whose variables place this process, and what they say (agreeing launchers fill each other's
    gaps); (None, {}) when no launcher's are set."""
    present = [(launcher, _reading(launcher, env)) for launcher in LAUNCHERS
               if env.get(launcher.rank) or env.get(launcher.world_size)]
    if not present:
        return None, {}
    marked = [(launcher, got) for launcher, got in present if launcher.marker and launcher.marker in env]
    if marked:
        return marked[0]  # it started this process inside the other launchers: its variables describe this worker
    (first, said), others = present[0], present[1:]
    for other, got in others:
        for field, what in _WHAT.items():
            (mine, name), (theirs, their_name) = said[field], got[field]
            if mine is not None and theirs is not None and mine != theirs:
                raise SettingsError(
                    f"{name}={mine} ({first.name}) and {their_name}={theirs} ({other.name}) disagree about this "
                    f"process's {what}; unset one launcher's variables or make them agree")
    return first, {field: next((got[field] for _, got in present if got[field][0] is not None), said[field])
                   for field in _PLACE}


def _check_below(got: Reading, index: str, size: str) -> None:
    (i, i_name), (n, n_name) = got[index], got[size]
    if i is not None and n is not None and i >= n:
        raise SettingsError(f"{i_name}={i} must be below {n_name}={n} (the {_WHAT[index]} within the {_WHAT[size]})")


@dataclass(frozen=True)
class RankEnv:
    """This process's place in its world and what it may use (a lone process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # among the ranks of this node
    local_world_size: int = 1
    node_rank: int | None = None  # None: the launcher does not say
    launcher: str | None = None  # whose variables placed it ("torchrun", "SLURM"), None: none
    host: str = ""
    cores: int = 1  # CPU cores this process may run on
    threads: int | None = None  # OMP_NUM_THREADS, when it is a number
    backend: str | None = None  # the process-group backend asked for ($COCOWEAVE_BACKEND), None: by device
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0  # torchrun's restart attempt of this worker
    agent_store: bool = False  # torchrun's agent serves the rendezvous store

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """Read the environment (os.environ unless given); SettingsError for a malformed or contradicting value."""
        env = os.environ if environ is None else environ
        launcher, reading = _resolve(env)
        if launcher is not None:
            _check_below(reading, "rank", "world_size")
            _check_below(reading, "local_rank", "local_world_size")
        got = {field: value for field, (value, _) in reading.items()}
        rank = got.get("rank") or 0
        world = got.get("world_size") or 1
        local_rank = got.get("local_rank")
        local_size = got.get("local_world_size")
        threads = env.get("OMP_NUM_THREADS", "")
        return cls(rank=rank, world_size=world, local_rank=rank if local_rank is None else local_rank,
                   local_world_size=world if local_size is None else local_size, node_rank=got.get("node_rank"),
                   launcher=launcher.name if launcher else None, host=socket.gethostname(), cores=cores(),
                   threads=int(threads) if threads.isdigit() else None, backend=settings.BACKEND.get(env),
                   master_addr=env.get("MASTER_ADDR") or None, master_port=_whole(env, "MASTER_PORT"),
                   restart_count=_whole(env, "TORCHELASTIC_RESTART_COUNT") or 0,
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")

    @classmethod
    def current(cls) -> RankEnv:
        """`from_env`, with torch.distributed's rank and world size once it is initialised."""
        env = cls.from_env()
        if dist.is_available() and dist.is_initialized():
            return replace(env, rank=dist.get_rank(), world_size=dist.get_world_size())
        return env

    def device(self, backend: str | None = None) -> tuple[torch.device, str]:
        """(device, backend) of this rank: see `torchrun_device`; `backend` overrides $COCOWEAVE_BACKEND."""
        return torchrun_device(self.local_rank, self.local_world_size, backend or self.backend)


def in_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by torchrun (or has RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    env = os.environ if environ is None else environ
    return TORCHRUN.marker in env or all(k in env for k in (TORCHRUN.rank, TORCHRUN.world_size, *RENDEZVOUS))


def missing_to_join(environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables a rank needs to join its process group that are unset: its launcher's rank and world size
    (torchrun's where no launcher's are set), MASTER_ADDR and MASTER_PORT."""
    env = os.environ if environ is None else environ
    launcher = next((x for x in LAUNCHERS if env.get(x.rank) or env.get(x.world_size)), TORCHRUN)
    return [name for name in (launcher.rank, launcher.world_size, *RENDEZVOUS) if not env.get(name)]


def torchrun_device(local_rank: int, local_size: int, backend: str | None = None) -> tuple[torch.device, str]:
    """(device, backend) of a launched rank: the CPU and Gloo without a GPU; with GPUs, GPU local_rank % count and
    NCCL when every local rank has its own GPU, Gloo with CUDA tensors when ranks share one. Examples must build
    their model on this device: NCCL refuses CPU tensors."""
    if torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        return torch.device("cuda", local_rank % n_gpus), backend or ("nccl" if local_size <= n_gpus else "gloo")
    if backend == "nccl":
        raise BackendError("backend nccl needs CUDA, and no GPU is visible to this rank")
    return torch.device("cpu"), backend or "gloo"


def environment() -> dict[str, str]:
    """A copy of this process's environment, for a rank started from elsewhere (LocalWorld's fork server) to adopt."""
    return dict(os.environ)


def adopt_environment(env: dict[str, str]) -> bool:
    """Make this process's environment `env` (a rank forked from a server takes its starter's as it is now, not the
    server's when it started); True when that changed anything."""
    if env == os.environ:
        return False
    os.environ.clear()
    os.environ.update(env)
    return True
