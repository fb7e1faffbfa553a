"""The shared-memory collective algorithm ("shm"): ranks of one host reduce, scatter and gather through memory
they all map, instead of sending bytes through Gloo's TCP loopback.

Each rank of a process group owns a slot of a segment that every rank of the group maps. A collective is: every rank
writes its operand into its slot (nothing to write when the operand already lives there, e.g. a gradient bucket the
optimizer allocated in shared memory), a barrier, every rank reads what it needs straight from the others' slots, a
barrier. A reduce-scatter then reads 1/p of every slot and reduces into its own part of its own slot (nobody else
reads that part); an all-reduce reduces its 1/p into its own slot and reads the others' reduced parts; an all-gather
reads the others' parts. An all-reduce on alternating slots can also be split in two (`Posted`): a rank writes and
flags its operand, computes something else, and reduces later, so the first to arrive does not wait. A state tensor
every rank holds whole and only an all-gather writes (an optimizer's parameters) can live in one segment all ranks
map (`common`): each rank computes its part in place there and the all-gather is a barrier, the tensor stored once
per host. This is DeepSpeed's CPU shared-memory all-reduce idea (and what NCCL's SHM transport does between GPUs of
a node), here as a checked schedule choice for every collective of a program.

Segments are anonymous (memfd_create, mode 0600, space reserved with posix_fallocate): they have no name in
/dev/shm, so nothing can be left there whatever kills a rank, and /dev/shm's size (Docker's 64 MiB) does not bound
them. The creating rank publishes "pid:fd" in the process group's store; the others open it through
/proc/<pid>/fd/<fd>, which the kernel allows only to processes of the same user that can see the creator's PID
(the same host and PID namespace), check owner, mode and size on the descriptor, and map it. The memory goes when
the last rank that maps it exits. A group is used only when that is proven at its creation (every rank opened
rank 0's segment and read the random nonce rank 0 wrote there); a peer's PID serves to notice its death only once
proven to name that peer here (/proc/<pid>/fd/<fd> is the same segment); anything else falls back to the library.

Barriers spin on one flag per rank (a 64-byte line each) with sched_yield between looks, so oversubscribed cores
keep working. The flags and the data rely on x86's total store order (stores become visible in program order);
on other processors, and when the ranks are not all on this host, every collective falls back to the library
call. Every wait is bounded by the process group's timeout (init_process_group(timeout=...),
cocoweave.launch.init_from_env(timeout_s=...)) and raises BackendError naming the group and what it waited for,
never a silent hang.
"""

from __future__ import annotations

import itertools
import os
import platform
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import BackendError
from ...ir.layout import slice_bounds
from ...rankenv import cores

SLOT_ALIGN = 64  # bytes: every slot of a segment starts on a cache line
LINE = 8  # int64 words per cache line: one line per rank ([flag, -, -, nonce (rank 0 / the sender), ...])
_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_GROUPS: dict[tuple[int, ...], ShmGroup | None] = {}
_SEQ: dict[str, itertools.count] = {}

# out = a op b, with out= a or b for in place ("avg" sums; the caller divides)
REDUCE: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum,
}


class ShmUnavailable(BackendError):
    """A segment could not be made (no memory to reserve, no memfd): the caller runs the library's collective."""


def group_timeout(group: Any = None) -> float:
    """The timeout of process group `group` (None: the default group) in seconds: how long any shared-memory wait
    may last, as the library collectives of that group."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return dist.default_pg_timeout.total_seconds()


def _alive(pid: int) -> bool:
    """Whether process `pid` (proven to be a peer on this host, see ShmGroup) is running: not gone, not a zombie. 0
    (not proven) counts as alive: that peer's death is noticed by the timeout."""
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


ALTERNATE_BYTES = 8 << 20  # an all-reduce of at most this many bytes per slot alternates two sets of slots
SPIN_S = 50e-6  # how long a waiting rank spins (yielding) before it sleeps between looks, ranks outnumbering cores
# ... and when every rank of the world has a core: a nap costs its waiter ~65 us to notice the peer (time.sleep(50 us)
# sleeps ~105 us on this VM: timer slack, the idle vCPU's wake-up), a yielding spin ~2 us, and the rank it waits for
# runs on another core meanwhile (tp_step d256: 40 barriers a step, most of them waits of 0.1-4 ms)
SPIN_OWN_CORE_S = 5e-3
NAP_S = 50e-6  # how long it then sleeps: a waiting rank leaves the core to the ranks it waits for


def _wait_until(ready: Callable[[], bool], check: Callable[[float], None], spin_s: float = SPIN_S) -> None:
    """Wait for `ready()`: spin (yielding the core) for `spin_s`, then sleep between looks, so that waiting ranks
    do not take the cores from the ranks they wait for (ranks outnumber cores, or other work runs); every fifth of
    a second `check(seconds waited)` may raise (a peer that died, the timeout)."""
    start = look = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now - start < spin_s:
            os.sched_yield()
        else:
            time.sleep(NAP_S)
        if now - look > 0.2:
            look = now
            check(now - start)


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def create(nbytes: int) -> int:
    """A new anonymous shared-memory segment of `nbytes` zero bytes, mode 0600 whatever the umask, every page
    reserved now (so that a full memory is an error here, not a SIGBUS at first touch): its descriptor."""
    if not hasattr(os, "memfd_create"):
        raise ShmUnavailable("this system has no memfd_create (Linux 3.17 or later)")
    try:
        fd = os.memfd_create("cocoweave-shm", os.MFD_CLOEXEC)
    except OSError as e:
        raise ShmUnavailable(f"memfd_create failed ({e.strerror})") from None
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        raise ShmUnavailable(f"could not reserve {nbytes} bytes of shared memory ({e.strerror}): the host or this "
                             "container's memory limit is reached") from None
    return fd


def open_peer(pid: int, fd: int, nbytes: int) -> int:
    """Open the segment process `pid` holds as descriptor `fd` (the kernel lets only a process of the same user that
    sees `pid` do it) and check on the descriptor that it is a segment of this user, mode 0600, of `nbytes`: a
    descriptor of it. OSError when the path cannot be opened; BackendError when it is not such a segment."""
    mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    st = os.fstat(mine)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size != nbytes:
        os.close(mine)
        raise BackendError(f"/proc/{pid}/fd/{fd} is not a shared-memory segment of this user (owner uid "
                           f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}, {st.st_size} bytes; expected uid "
                           f"{os.geteuid()}, 600, {nbytes}): refusing to map it")
    return mine


def mapped(fd: int, nbytes: int) -> torch.Tensor:
    """The bytes of segment `fd`, mapped shared (the mapping keeps the memory after `fd` is closed)."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


def _proven(pid: int, fd: int, mine: int) -> int:
    """`pid` if /proc/<pid>/fd/<fd> is the segment this process holds as `mine` (so `pid` names that peer in this
    PID namespace), else 0: the peer's death is then noticed by the timeout, not by its PID."""
    try:
        there, here = os.stat(f"/proc/{pid}/fd/{fd}"), os.fstat(mine)
    except OSError:
        return 0
    return pid if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino) else 0


def _published(store: Any, name: str, timeout: float, what: str) -> str:
    """The value of store key `name`, waiting at most `timeout` s for it (BackendError naming `what` otherwise)."""
    try:
        store.wait([name], timedelta(seconds=timeout))
        return store.get(name).decode()
    except RuntimeError as e:  # DistStoreError: the wait timed out or the store is gone
        raise BackendError(f"rank {dist.get_rank()}: waited {timeout:g} s (the process group's timeout) for {what} "
                           f"({type(e).__name__})") from None


def _map(key: str, nbytes: int, ranks: Sequence[int], timeout: float) -> tuple[torch.Tensor, int | None]:
    """A zero-filled byte segment of `nbytes` mapped by every rank of `ranks` (this rank among them), and on group
    rank 0 its descriptor, to close once every rank has mapped it. Rank 0 creates it and publishes "pid:fd" in the
    process group's store (or why it could not: every rank then raises ShmUnavailable)."""
    store = _store()
    me = ranks.index(dist.get_rank())
    name = f"cocoweave/shm/{key}"
    if me == 0:
        try:
            fd = create(nbytes)
        except ShmUnavailable as e:
            store.set(name, f"none:{e}")
            raise
        store.set(name, f"{os.getpid()}:{fd}")
        return mapped(fd, nbytes), fd
    where = _published(store, name, timeout, f"rank {ranks[0]} to make shared-memory segment {key}")
    if where.startswith("none:"):
        raise ShmUnavailable(f"rank {ranks[0]}: {where[5:]}")
    pid, fd = map(int, where.split(":"))
    try:
        mine = open_peer(pid, fd, nbytes)
    except OSError as e:
        raise BackendError(f"rank {dist.get_rank()}: could not open the shared-memory segment {key} of rank "
                           f"{ranks[0]} ({e.strerror}): it exited") from None
    try:
        return mapped(mine, nbytes), None
    finally:
        os.close(mine)


def _unique(prefix: str) -> str:
    """`prefix` with the number of segments this process made under it before: every rank of a group makes the
    same segments in the same order (SPMD), so the keys agree without a collective."""
    return f"{prefix}/{next(_SEQ.setdefault(prefix, itertools.count()))}"


class ShmGroup:
    """The ranks of one process group on this host: a barrier over shared flags, and segments with one slot per
    rank. Made by `group_for`, which proves that the ranks share memory."""

    def __init__(self, ranks: Sequence[int], flags: torch.Tensor, fd: int, peers: Sequence[tuple[int, int]],
                 timeout: float):
        self.ranks = list(ranks)
        self.size, self.me = len(ranks), self.ranks.index(dist.get_rank())
        self.key = "-".join(map(str, ranks))
        self.flags = flags.view(torch.int64).view(self.size, LINE)[:, 0]
        self._flags = self.flags.numpy()  # the same memory: a look at it costs ~0.6 us, a torch op ~6
        # every rank of the world has a core of its own (else a waiting rank soon naps: see SPIN_OWN_CORE_S)
        self.spin_s = SPIN_OWN_CORE_S if dist.get_world_size() <= cores() else SPIN_S
        self.fd, self.timeout = fd, timeout  # fd stays open: the peers prove our PID with it
        # a peer's PID, where proven to name it here (0: its death is noticed by the timeout only)
        self.pids = [os.getpid() if j == self.me else _proven(pid, pfd, fd) for j, (pid, pfd) in enumerate(peers)]
        self.pending: list[int] = []  # descriptors of segments made here, closed once every rank has mapped them
        self.epoch = 0

    def barrier(self) -> None:
        """Wait until every rank of the group has reached its same-numbered barrier."""
        self.wait(self.arrive())

    def arrive(self) -> int:
        """Flag that this rank reached its next barrier, without waiting there: the barrier's number (for `arrived`
        and `wait`). Nothing of the group's may run on this rank between the two."""
        self.epoch += 1
        self._flags[self.me] = self.epoch
        return self.epoch

    def arrived(self, epoch: int) -> bool:
        """Whether every rank of the group has reached barrier `epoch`: one look, no wait."""
        return min(self._flags.tolist()) >= epoch

    def wait(self, epoch: int) -> None:
        """Wait until every rank of the group has reached barrier `epoch` (this rank arrived there)."""
        flags = self._flags

        def late() -> list[int]:
            return [i for i, e in enumerate(flags.tolist()) if e < epoch]

        def check(waited: float) -> None:
            dead = [i for i in late() if not _alive(self.pids[i])]
            if dead:
                raise BackendError(f"rank {dist.get_rank()}: rank {self.ranks[dead[0]]} exited while the ranks "
                                   f"{self.ranks} waited for it in a shared-memory barrier")
            if waited > self.timeout:
                slow = [self.ranks[i] for i in late()]
                raise BackendError(f"rank {dist.get_rank()}: shared-memory barrier of ranks {self.ranks} waited "
                                   f"{self.timeout:g} s (the process group's timeout) for "
                                   f"rank{'s' if len(slow) > 1 else ''} {', '.join(map(str, slow))}")

        _wait_until(lambda: min(flags.tolist()) >= epoch, check, self.spin_s)
        while self.pending:  # every rank mapped them before it reached this barrier
            os.close(self.pending.pop())

    def slots(self, prefix: str, numel: int, dtype: torch.dtype, count: int | None = None) -> list[torch.Tensor]:
        """A new segment of one slot of `numel` elements per rank (index i: group rank i's slot), or of `count`
        slots (count=1: one tensor all ranks of the group share). ShmUnavailable (on every rank) when it cannot be
        made."""
        per = -(-numel * dtype.itemsize // SLOT_ALIGN) * SLOT_ALIGN
        count = self.size if count is None else count
        seg, fd = _map(_unique(f"{self.key}/{prefix}"), max(per * count, SLOT_ALIGN), self.ranks, self.timeout)
        if fd is not None:
            self.pending.append(fd)
        out = Slots(seg[i * per:i * per + numel * dtype.itemsize].view(dtype) for i in range(count))
        out.group = self
        return out


class Slots(list):
    """The slots of one collective (index i: group rank i's), with what an all-reduce keeps beside them: a second
    set it alternates with (made on first use, see `all_reduce`), and whether a caller was lent one of them to
    compute into (`lend`: then it never alternates)."""

    group: ShmGroup | None = None
    lent = False
    spare: list[torch.Tensor] | None = None
    turn = 0


def lend(slots: list[torch.Tensor]) -> None:
    """Mark `slots` as lent (Executable.shared_input: an operand is computed in this rank's slot): its owner writes
    it right after a collective, so every collective on them ends with a barrier. Every rank of the group lends, at
    the same point: lent after an all-reduce that ended without one, a barrier orders that one's reads first."""
    if isinstance(slots, Slots) and not slots.lent:
        slots.lent = True
        if slots.spare is not None and slots.group is not None:
            slots.group.barrier()


_WHY: dict[tuple[int, ...], str] = {}  # why a group's ranks do not share memory, for the fallback's warning


def why_not(group: Any) -> str:
    """Why `group_for(group)` is None, in a few words."""
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    return _WHY.get(ranks, "")


def group_for(group: Any) -> ShmGroup | None:
    """The ShmGroup of a torch.distributed group, or None when its ranks cannot share memory (another host, another
    PID namespace or user, a processor without total store order, no memory to reserve, one rank). A collective of
    the group on first use: rank 0 makes the flags segment with a random nonce in it, every other rank must open it
    and read the nonce back, and all agree on the result."""
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    if ranks not in _GROUPS:
        _GROUPS[ranks] = _prove(group, ranks) if len(ranks) > 1 else None
    return _GROUPS[ranks]


def _prove(group: Any, ranks: tuple[int, ...]) -> ShmGroup | None:
    me, size, timeout = ranks.index(dist.get_rank()), len(ranks), group_timeout(group)
    nbytes = size * LINE * 8
    fd, seg, why, nonce = None, None, "", secrets.randbits(62)
    if me == 0 and _ORDERED:
        try:
            fd = create(nbytes)
            seg = mapped(fd, nbytes)
            seg.view(torch.int64)[3] = nonce
        except ShmUnavailable as e:
            why = str(e)
    infos: list[Any] = [None] * size
    dist.all_gather_object(infos, (_ORDERED, os.getpid(), fd, nonce, why), group=group)
    if not all(i[0] for i in infos):
        why = "a processor without total store order"
    elif infos[0][2] is None:
        why = f"rank {ranks[0]} could not make a segment: {infos[0][4]}"
    elif me != 0:
        try:
            fd = open_peer(infos[0][1], infos[0][2], nbytes)
            seg = mapped(fd, nbytes)
            if int(seg.view(torch.int64)[3]) != infos[0][3]:
                why = f"rank {dist.get_rank()} opened another segment than rank {ranks[0]}'s"
        except (OSError, BackendError) as e:
            why = f"rank {dist.get_rank()} could not open rank {ranks[0]}'s segment ({getattr(e, 'strerror', e)})"
    agreed: list[Any] = [None] * size
    dist.all_gather_object(agreed, (why, os.getpid(), fd), group=group)
    whys = [w for w, _, _ in agreed if w]
    if whys or seg is None or fd is None:
        if fd is not None:
            os.close(fd)
        _WHY[ranks] = whys[0] if whys else why
        return None
    g = ShmGroup(ranks, seg, fd, [(pid, pfd) for _, pid, pfd in agreed], timeout)
    # no rank leaves before every rank proved the others' PIDs: a peer that dies from here on is noticed by its PID
    dist.all_gather_object([None] * size, None, group=group)
    return g


class ShmBuffers:
    """The slots one collective of an executable uses, made on first use and kept for every later step; and the
    tensors its ranks share whole (`common`)."""

    def __init__(self) -> None:
        self.slots: dict[Any, list[torch.Tensor]] = {}
        self.commons: dict[Any, list[torch.Tensor]] = {}
        self.failed: dict[Any, ShmUnavailable] = {}  # (key, numel, dtype) with no segment: the same on every rank

    def get(self, g: ShmGroup, key: Any, numel: int, dtype: torch.dtype, common: bool = False) -> list[torch.Tensor]:
        """The slots of `key` (made on first use, or when the size or dtype changed); with `common`, one tensor in
        a list, which every rank of the group shares."""
        store = self.commons if common else self.slots
        s = store.get(key)
        if s is None or s[0].numel() != numel or s[0].dtype != dtype:
            if (key, numel, dtype) in self.failed:
                raise self.failed[key, numel, dtype]
            try:
                s = store[key] = g.slots(str(key), numel, dtype, 1 if common else None)
            except ShmUnavailable as e:
                self.failed[key, numel, dtype] = e
                raise
        return s


def _write(slot: torch.Tensor, flat: torch.Tensor) -> None:
    if slot.data_ptr() != flat.data_ptr():  # an operand that already lives in the slot needs no copy
        slot.copy_(flat)


def _reduce(slots: list[torch.Tensor], start: int, n: int, op: str, out: torch.Tensor, first: int) -> torch.Tensor:
    """out = op over every slot's elements [start, start + n), `slots[first]`'s already in `out`."""
    for j, slot in enumerate(slots):
        if j != first:
            REDUCE[op](out, slot[start:start + n], out=out)
    if op == "avg":
        out.div_(len(slots))
    return out


def reduce_scatter(g: ShmGroup, slots: list[torch.Tensor], flat: torch.Tensor, op: str,
                   parts: list[tuple[int, int]], out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's `flat` reduced with `op`; this rank's part (start, length in `parts`) into `out`, or, when
    `out` is None, in place into this rank's part of its own slot (as Megatron-core reduce-scatters into its
    gradient buffer's shard: no result buffer; nobody else reads that part of this slot), returned as a view. Where
    two sets of slots alternate (`_alternate`) no barrier ends it, as an all-reduce's."""
    use, ends = _post(g, slots, flat)
    start, n = parts[g.me]
    if out is None:
        out = _reduce(use, start, n, op, use[g.me][start:start + n], g.me)
    else:
        out.copy_(use[0][start:start + n])
        _reduce(use, start, n, op, out, 0)
    if ends:
        g.barrier()  # nobody reads a slot after this: its owner may write it again
    return out


def _post(g: ShmGroup, slots: list[torch.Tensor], flat: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """The opening of every slot collective: this rank's `flat` into its slot of the set this call uses (`_alternate`),
    then the barrier after which every rank reads the others'. Returns the set and whether a barrier must end the call
    (the set does not alternate: its owners write it again at the next call)."""
    use = _alternate(g, slots)
    ends = use is None
    use = slots if use is None else use
    _write(use[g.me][:flat.numel()], flat)
    g.barrier()
    return use, ends


def _alternate(g: ShmGroup, slots: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The set of slots this collective (all-reduce, reduce-scatter, all-gather) uses when it alternates two sets (None:
    it does not, see `all_reduce`): `slots` and a second set made on the first call, in turns. A rank writes a set
    again two calls later, after the next call's barrier, which every rank reaches only once it has read this call's
    slots: no barrier needs to end a call. The same on every rank: the calls, sizes, lending and a failure to make
    the second set (published by rank 0) are."""
    if not isinstance(slots, Slots) or slots.lent or slots[0].numel() * slots[0].element_size() > ALTERNATE_BYTES:
        return None
    if slots.spare is None:
        try:
            slots.spare = g.slots("alternate", slots[0].numel(), slots[0].dtype)
        except ShmUnavailable:
            slots.lent = True  # no second set: three barriers, on every rank
            return None
    slots.turn ^= 1
    return slots.spare if slots.turn else slots


def shares(t: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `t` lives in the storage of one of `tensors` (e.g. a collective's slots, with the set they alternate
    with)."""
    ptr = t.untyped_storage().data_ptr()
    spare = getattr(tensors, "spare", None) or ()
    return any(s.untyped_storage().data_ptr() == ptr for s in (*tensors, *spare))


def all_reduce(g: ShmGroup, slots: list[torch.Tensor], flat: torch.Tensor, op: str,
               parts: list[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
    """Every rank's `flat` reduced with `op`, whole, into `out`: each rank reduces its part into its own slot,
    then everyone reads the reduced parts. Where two sets of slots alternate, no barrier ends it: a rank writes
    a set again two calls later, after the next call's first barrier, which every rank reaches only once it has
    read this call's parts; a lent slot (its owner writes it right after) or a large one keeps the third. At two
    ranks with alternating sets each rank reduces the whole from both slots straight into `out` (`_direct`)."""
    use, ends = _post(g, slots, flat)
    return _all_reduced(g, use, flat.numel(), op, parts, out, ends)


def _all_reduced(g: ShmGroup, use: list[torch.Tensor], numel: int, op: str, parts: list[tuple[int, int]],
                 out: torch.Tensor, ends: bool) -> torch.Tensor:
    """The rest of an all-reduce once every rank's operand is in its slot of `use` (every rank passed the barrier
    after the writes): the reduction into `out`; `ends`: the slots do not alternate (a barrier ends the call)."""
    if not ends and g.size == 2 and not shares(out, use):
        return _direct(use, numel, op, out)
    start, n = parts[g.me]
    _reduce(use, start, n, op, use[g.me][start:start + n], g.me)
    g.barrier()
    for j, (s, k) in enumerate(parts):
        out[s:s + k].copy_(use[j][s:s + k])
    if ends:
        g.barrier()
    return out


class Posted:
    """An all-reduce in two halves, so that a rank computes between them while its peers arrive (Megatron's
    asynchronous input-gradient all-reduce, on shared memory, progressed by the caller rather than by a thread that
    would take the rank's core): the operand is computed straight into `slot` (no copy), `arrive()` flags it,
    `ready()` says whether every rank has arrived, `finish()` reduces into `out` (waiting for the late ones) once.
    Only on alternating slot sets (`open_all_reduce`), so that no barrier ends it; no other collective of the group
    may run on this rank between `arrive` and `finish`."""

    def __init__(self, g: ShmGroup, use: list[torch.Tensor], numel: int, op: str, parts: list[tuple[int, int]],
                 out: torch.Tensor) -> None:
        self.g, self.use, self.numel, self.op, self.parts, self.out = g, use, numel, op, parts, out
        self.slot = use[g.me][:numel]
        self.epoch = 0
        self.done = False

    def arrive(self) -> None:
        self.epoch = self.g.arrive()

    def ready(self) -> bool:
        return self.g.arrived(self.epoch)

    def finish(self) -> torch.Tensor:
        if not self.done:
            self.g.wait(self.epoch)
            _all_reduced(self.g, self.use, self.numel, self.op, self.parts, self.out.view(-1), False)
            self.done = True
        return self.out


def open_all_reduce(g: ShmGroup, slots: list[torch.Tensor], numel: int, op: str, out: torch.Tensor) -> Posted | None:
    """An all-reduce of `numel` elements on `slots` into `out` split in two (`Posted`; each rank reduces its
    tensor_split part), or None where the slots do not alternate (lent, large, no second set: the same on every
    rank), for the caller's blocking route."""
    use = _alternate(g, slots)
    if use is None:
        return None
    parts = [(a, b - a) for a, b in (slice_bounds(numel, g.size, i) for i in range(g.size))]
    return Posted(g, use, numel, op, parts, out)


def _direct(slots: list[torch.Tensor], n: int, op: str, out: torch.Tensor) -> torch.Tensor:
    """out = slots[0][:n] op slots[1][:n] (two ranks), in that order on every rank, so every rank holds the same bits:
    one pass over the slots, no barrier after the write. This reads what the split reduction reads (half each of
    both slots, then the other half reduced) without writing the half back or a second barrier (tp_step d256: 16
    all-reduces of 1 MiB a step)."""
    out = REDUCE[op](slots[0][:n], slots[1][:n], out=out.view(-1))
    return out.div_(2) if op == "avg" else out


def all_gather(g: ShmGroup, slots: list[torch.Tensor], part: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Group rank j's `part` (flat) into outs[j] (any shape of that many elements) on every rank. Where two sets of
    slots alternate (`_alternate`) no barrier ends it, as an all-reduce's."""
    use, ends = _post(g, slots, part)
    for j, dst in enumerate(outs):
        if dst.numel():
            dst.copy_((use[j] if j != g.me else part)[:dst.numel()].view(dst.shape))
    if ends:
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
    and raises `sent`, the receiver copies and raises `taken`; the sender writes again only after `taken`. Made by
    `Pair.make`, which proves that the two share memory."""

    def __init__(self, seg: torch.Tensor, numel: int, dtype: torch.dtype, pid: int, timeout: float):
        lines = seg[:128].view(torch.int64).view(2, LINE)
        self.flags = lines[:, 0]  # [sent, taken]
        self.data = seg[128:128 + numel * dtype.itemsize].view(dtype)
        self.peer_pid, self.timeout = pid, timeout  # the peer's PID where proven, else 0
        self.epoch = 0

    @staticmethod
    def make(sender: int, receiver: int, key: str, numel: int, dtype: torch.dtype) -> Pair | None:
        """The pair of `sender` and `receiver` (both call it for the same `key`), or None on both when they do not
        share memory (the library's send then): the sender makes the segment with a nonce, the receiver must open
        it and read the nonce, and says so through the store."""
        store, timeout, me = _store(), group_timeout(), dist.get_rank()
        name = f"cocoweave/shm/{_unique(f'p2p-{sender}-{receiver}/{key}')}"
        nbytes = 128 + max(numel * dtype.itemsize, 1)
        if me == sender:
            nonce = secrets.randbits(62)
            try:
                fd = create(nbytes)
            except ShmUnavailable as e:
                store.set(name, f"none:{e}")
                return None
            seg = mapped(fd, nbytes)
            seg[:128].view(torch.int64)[3] = nonce
            store.set(name, f"{os.getpid()}:{fd}:{nonce}")
            answer = _published(store, f"{name}/ok", timeout, f"rank {receiver} to map a shared-memory send")
            ok, pid, rfd = map(int, answer.split(":"))
            pid = _proven(pid, rfd, fd) if ok else 0
            os.close(fd)
            return Pair(seg, numel, dtype, pid, timeout) if ok else None
        where = _published(store, name, timeout, f"rank {sender} to make a shared-memory send")
        if where.startswith("none:"):
            return None
        pid, fd, nonce = map(int, where.split(":"))
        try:
            mine = open_peer(pid, fd, nbytes)
        except (OSError, BackendError):
            store.set(f"{name}/ok", "0:0:0")
            return None
        seg = mapped(mine, nbytes)
        ok = int(seg[:128].view(torch.int64)[3]) == nonce
        store.set(f"{name}/ok", f"{int(ok)}:{os.getpid()}:{mine}")  # kept open: the sender proves our PID with it
        if not ok:
            os.close(mine)
        return Pair(seg, numel, dtype, pid, timeout) if ok else None

    def _wait(self, i: int, what: str) -> None:
        def check(waited: float) -> None:
            if not _alive(self.peer_pid):
                raise BackendError(f"rank {dist.get_rank()}: its peer exited while it waited for it to {what} a "
                                   "shared-memory send")
            if waited > self.timeout:
                raise BackendError(f"rank {dist.get_rank()}: waited {self.timeout:g} s (the process group's timeout) "
                                   f"for its peer to {what} a shared-memory send")

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
