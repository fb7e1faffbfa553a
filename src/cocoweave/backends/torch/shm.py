"""The shared-memory collective algorithm ("shm"): ranks of one host reduce, scatter and gather through memory
they all map, instead of sending bytes through Gloo's TCP loopback.

Each rank of a process group owns a slot of a segment (a file in /dev/shm mapped by every rank of the group and
unlinked as soon as all have mapped it, so nothing outlives the processes). A collective is: every rank writes its
operand into its slot (nothing to write when the operand already lives there, e.g. a gradient bucket the
optimizer allocated in shared memory), a barrier, every rank reads what it needs straight from the others' slots,
a barrier. A reduce-scatter then reads 1/p of every slot and reduces into its own part of its own slot (nobody else
reads that part); an all-reduce reduces its 1/p into its own slot and reads the others' reduced parts; an all-gather
reads the others' parts. A state tensor every rank holds whole and only an all-gather writes (an optimizer's
parameters) can live in one segment all ranks map (`common`): each rank computes its part in place there and the
all-gather is a barrier, the tensor stored once per host. This is DeepSpeed's
CPU shared-memory all-reduce idea (and what NCCL's SHM transport does between GPUs of a node), here as a checked
schedule choice for every collective of a program.

Barriers spin on one flag per rank (a 64-byte line each) with sched_yield between looks, so oversubscribed cores
keep working. The flags and the data rely on x86's total store order (stores become visible in program order);
on other processors, and when the ranks are not all on this host, every collective falls back to the library
call. A barrier that waits longer than the timeout raises BackendError naming the group and the ranks it waited
for, never a silent hang.
"""

from __future__ import annotations

import itertools
import os
import platform
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import BackendError

LINE = 8  # int64 flags per cache line: one line per rank
TIMEOUT_ENV = "COCOWEAVE_SHM_TIMEOUT"
_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_GROUPS: dict[tuple[int, ...], ShmGroup | None] = {}
_SEQ: dict[str, itertools.count] = {}
_PEERS: dict[tuple[int, int], bool] = {}

REDUCE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "sum": lambda acc, x: acc.add_(x), "avg": lambda acc, x: acc.add_(x),
    "max": lambda acc, x: torch.maximum(acc, x, out=acc), "min": lambda acc, x: torch.minimum(acc, x, out=acc),
}


def _timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "300"))


def _alive(pid: int) -> bool:
    """Whether process `pid` (on this host) is running: not gone, not a zombie. 0 (not known yet) counts as alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


SPIN_S = 50e-6  # how long a waiting rank spins (yielding) before it sleeps between looks
NAP_S = 50e-6  # how long it then sleeps: a waiting rank leaves the core to the ranks it waits for


def _wait_until(ready: Callable[[], bool], check: Callable[[float], None]) -> None:
    """Wait for `ready()`: spin (yielding the core) for a moment, then sleep between looks, so that waiting ranks
    do not take the cores from the ranks they wait for (ranks outnumber cores, or other work runs); every fifth of
    a second `check(seconds waited)` may raise (a peer that died, the timeout)."""
    start = look = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now - start < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(NAP_S)
        if now - look > 0.2:
            look = now
            check(now - start)


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _map(key: str, nbytes: int, ranks: Sequence[int]) -> torch.Tensor:
    """A zero-filled byte segment of `nbytes` mapped by every rank of `ranks` (this rank among them). Group rank 0
    creates the file and publishes its path in the process group's store; the last rank to map it unlinks it."""
    store = _store()
    me = ranks.index(dist.get_rank())
    name = f"cocoweave/shm/{key}"
    if me == 0:
        path = f"/dev/shm/cocoweave-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open(path, "wb") as f:
            f.truncate(nbytes)
        store.set(name, path)
    else:
        path = store.get(name).decode()
    seg = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    if store.add(f"{name}/mapped", 1) == len(ranks):
        os.unlink(path)
    return seg


def _unique(prefix: str) -> str:
    """`prefix` with the number of segments this process made under it before: every rank of a group makes the
    same segments in the same order (SPMD), so the keys agree without a collective."""
    return f"{prefix}/{next(_SEQ.setdefault(prefix, itertools.count()))}"


class ShmGroup:
    """The ranks of one process group on this host: a barrier over shared flags, and segments with one slot per
    rank."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)
        self.size, self.me = len(ranks), self.ranks.index(dist.get_rank())
        self.key = "-".join(map(str, ranks))
        lines = _map(_unique(f"{self.key}/flags"), self.size * LINE * 8, ranks).view(torch.int64).view(self.size, LINE)
        self.flags, self.pids = lines[:, 0], lines[:, 1]
        self.pids[self.me] = os.getpid()  # so that a waiting rank can tell a peer that died from one that is slow
        self.epoch = 0

    def barrier(self) -> None:
        """Wait until every rank of the group has reached its same-numbered barrier."""
        self.epoch += 1
        self.flags[self.me] = self.epoch

        def late() -> list[int]:
            return [i for i, e in enumerate(self.flags.tolist()) if e < self.epoch]

        def check(waited: float) -> None:
            dead = [i for i in late() if not _alive(int(self.pids[i]))]
            if dead:
                raise BackendError(f"rank {dist.get_rank()}: rank {self.ranks[dead[0]]} exited while the ranks "
                                   f"{self.ranks} waited for it in a shared-memory barrier")
            if waited > _timeout():
                slow = [self.ranks[i] for i in late()]
                raise BackendError(f"rank {dist.get_rank()}: shared-memory barrier of ranks {self.ranks} waited "
                                   f"{_timeout():g} s for rank{'s' if len(slow) > 1 else ''} "
                                   f"{', '.join(map(str, slow))}")

        _wait_until(lambda: int(self.flags.min()) >= self.epoch, check)

    def slots(self, prefix: str, numel: int, dtype: torch.dtype, count: int | None = None) -> list[torch.Tensor]:
        """A new segment of one slot of `numel` elements per rank (index i: group rank i's slot), or of `count`
        slots (count=1: one tensor all ranks of the group share)."""
        per = -(-numel * dtype.itemsize // 64) * 64  # each slot starts on a cache line
        count = self.size if count is None else count
        seg = _map(_unique(f"{self.key}/{prefix}"), max(per * count, 64), self.ranks)
        return [seg[i * per:i * per + numel * dtype.itemsize].view(dtype) for i in range(count)]


def group_for(group: Any) -> ShmGroup | None:
    """The ShmGroup of a torch.distributed group, or None when its ranks cannot share memory (another host, a
    processor without total store order, one rank)."""
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    if ranks not in _GROUPS:
        hosts: list[Any] = [None] * len(ranks)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        ok = _ORDERED and len(ranks) > 1 and len(set(hosts)) == 1 and os.path.isdir("/dev/shm")
        _GROUPS[ranks] = ShmGroup(ranks) if ok else None
    return _GROUPS[ranks]


def same_host(peer: int) -> bool:
    """Whether world rank `peer` shares this host's memory with this rank (asked once per peer)."""
    key = (min(peer, dist.get_rank()), max(peer, dist.get_rank()))
    if key not in _PEERS:
        store, me = _store(), dist.get_rank()
        store.set(f"cocoweave/host/{me}", socket.gethostname())
        _PEERS[key] = _ORDERED and store.get(f"cocoweave/host/{peer}").decode() == socket.gethostname()
    return _PEERS[key]


class ShmBuffers:
    """The slots one collective of an executable uses, made on first use and kept for every later step; and the
    tensors its ranks share whole (`common`)."""

    def __init__(self) -> None:
        self.slots: dict[Any, list[torch.Tensor]] = {}
        self.commons: dict[Any, list[torch.Tensor]] = {}

    def get(self, g: ShmGroup, key: Any, numel: int, dtype: torch.dtype, common: bool = False) -> list[torch.Tensor]:
        """The slots of `key` (made on first use, or when the size or dtype changed); with `common`, one tensor in
        a list, which every rank of the group shares."""
        store = self.commons if common else self.slots
        s = store.get(key)
        if s is None or s[0].numel() != numel or s[0].dtype != dtype:
            s = store[key] = g.slots(str(key), numel, dtype, 1 if common else None)
        return s


def _write(slot: torch.Tensor, flat: torch.Tensor) -> None:
    if slot.data_ptr() != flat.data_ptr():  # an operand that already lives in the slot needs no copy
        slot.copy_(flat)


def _reduce(slots: list[torch.Tensor], start: int, n: int, op: str, out: torch.Tensor, first: int) -> torch.Tensor:
    """out = op over every slot's elements [start, start + n), `slots[first]`'s already in `out`."""
    for j, slot in enumerate(slots):
        if j != first:
            REDUCE[op](out, slot[start:start + n])
    if op == "avg":
        out.div_(len(slots))
    return out


def reduce_scatter(g: ShmGroup, slots: list[torch.Tensor], flat: torch.Tensor, op: str,
                   parts: list[tuple[int, int]], out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's `flat` reduced with `op`; this rank's part (start, length in `parts`) into `out`, or, when
    `out` is None, in place into this rank's part of its own slot (as Megatron-core reduce-scatters into its
    gradient buffer's shard: no result buffer; nobody else reads that part of this slot), returned as a view."""
    _write(slots[g.me][:flat.numel()], flat)
    g.barrier()
    start, n = parts[g.me]
    if out is None:
        out = _reduce(slots, start, n, op, slots[g.me][start:start + n], g.me)
    else:
        out.copy_(slots[0][start:start + n])
        _reduce(slots, start, n, op, out, 0)
    g.barrier()  # nobody reads a slot after this: its owner may write it again
    return out


def all_reduce(g: ShmGroup, slots: list[torch.Tensor], flat: torch.Tensor, op: str,
               parts: list[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
    """Every rank's `flat` reduced with `op`, whole, into `out`: each rank reduces its part into its own slot,
    then everyone reads the reduced parts."""
    _write(slots[g.me][:flat.numel()], flat)
    g.barrier()
    start, n = parts[g.me]
    _reduce(slots, start, n, op, slots[g.me][start:start + n], g.me)
    g.barrier()
    for j, (s, k) in enumerate(parts):
        out[s:s + k].copy_(slots[j][s:s + k])
    g.barrier()
    return out


def all_gather(g: ShmGroup, slots: list[torch.Tensor], part: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Group rank j's `part` (flat) into outs[j] (any shape of that many elements) on every rank."""
    _write(slots[g.me][:part.numel()], part)
    g.barrier()
    for j, dst in enumerate(outs):
        if dst.numel():
            dst.copy_((slots[j] if j != g.me else part)[:dst.numel()].view(dst.shape))
    g.barrier()


def gather_in_place(g: ShmGroup, wholes: list[torch.Tensor], bounds: list[tuple[int, int]],
                    part: torch.Tensor) -> None:
    """All-gather where every rank's destination is its own slot of `wholes` (a state tensor living in shared memory,
    e.g. an optimizer's parameters): each rank's part is already in its destination at [start, start + length) of
    `bounds`, so the others copy it from there. No slot is written, nothing else is read."""
    me = wholes[g.me]
    start, n = bounds[g.me]
    if n and part.data_ptr() != me[start:start + n].data_ptr():
        me[start:start + n].copy_(part.reshape(-1))
    g.barrier()
    for j, (s, k) in enumerate(bounds):
        if j != g.me and k:
            me[s:s + k].copy_(wholes[j][s:s + k])
    g.barrier()  # a rank changes its part again only after every other rank has copied it


def gather_common(g: ShmGroup, whole: torch.Tensor, bounds: list[tuple[int, int]], part: torch.Tensor) -> None:
    """All-gather into one tensor every rank of the group maps (Executable.shared_input: an optimizer's parameters
    stored once per host): each rank's part goes to [start, start + length) of `bounds` (nothing to copy when it
    was computed there), then one barrier. The caller guarantees that no rank writes its part again before every
    rank is done reading the whole: a step that opens with a shared-memory collective of the group does (its
    first barrier comes after everything read before it)."""
    start, n = bounds[g.me]
    if n and part.data_ptr() != whole[start:start + n].data_ptr():
        whole[start:start + n].copy_(part.reshape(-1))
    g.barrier()


class Pair:
    """Point-to-point through shared memory between a sender and a receiver of one host: the sender writes its slot
    and raises `sent`, the receiver copies and raises `taken`; the sender writes again only after `taken`."""

    def __init__(self, sender: int, receiver: int, key: str, numel: int, dtype: torch.dtype):
        ranks = [sender, receiver]
        itemsize = dtype.itemsize
        seg = _map(_unique(f"p2p-{sender}-{receiver}/{key}"), 128 + max(numel * itemsize, 1), ranks)
        lines = seg[:128].view(torch.int64).view(2, LINE)
        self.flags, self.pids = lines[:, 0], lines[:, 1]  # [sent, taken] and [sender's pid, receiver's pid]
        self.pids[ranks.index(dist.get_rank())] = os.getpid()
        self.data = seg[128:128 + numel * itemsize].view(dtype)
        self.epoch = 0

    def _wait(self, i: int, what: str) -> None:
        def check(waited: float) -> None:
            if not _alive(int(self.pids[i])):  # flag 0 is raised by the sender (pid 0), flag 1 by the receiver
                raise BackendError(f"rank {dist.get_rank()}: its peer exited while it waited for it to {what} a "
                                   "shared-memory send")
            if waited > _timeout():
                raise BackendError(f"rank {dist.get_rank()}: waited {_timeout():g} s for its peer to {what} a "
                                   "shared-memory send")

        _wait_until(lambda: int(self.flags[i]) >= self.epoch, check)

    def send(self, x: torch.Tensor) -> None:
        if self.epoch:
            self._wait(1, "take")  # the previous message was taken: the slot is free
        self.data.copy_(x.reshape(-1))
        self.epoch += 1
        self.flags[0] = self.epoch

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        self.epoch += 1
        self._wait(0, "make")
        out.reshape(-1).copy_(self.data)
        self.flags[1] = self.epoch
        return out
