"""A shared-memory all_to_all with uneven splits for ranks of one host (issue #47: the MoE layer's dispatch and
combine, whose per-rank row counts are runtime values from its router), on shm.py's groups, segments and barriers.

Each rank of a group owns a header slot (int64: the call's number, the bytes it sends, and the byte offset where
the rows for each rank start) and a data slot. A call: every rank writes its header and the rows it sends to the
*other* ranks (its own stay where they are) into its slots and flags that it arrived; once every rank has, each
reads from every other rank's data slot the bytes that rank's header says are its own, and copies its own rows
straight from its operand. Two sets of slots alternate, so no barrier ends a call (a rank writes a set again two
calls later, after the next call's barrier, which every rank reaches only once it has read this call's). The data
slots grow when a call needs more than they hold: every rank reads every header, so all agree on the need, make the
larger segment together and write again. A call can be split in two (`start`, then `Exchange.wait`): the rank
computes between them while its peers arrive. No other shared-memory collective of the group may run on a rank
between a start and its wait (as shm.Posted).

Failure behaviour is shm.py's: a peer that exits or stays away past the process group's timeout is one
BackendError naming it (the barrier's), a segment that cannot be made falls back to the library's
all_to_all_single on every rank (the same decision everywhere: rank 0 publishes it), and splits that disagree
between sender and receiver are one BackendError, never wrong rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import BackendError
from . import shm

GROW = 1.5  # a data slot that must grow takes this much more than the call needs (routings vary step to step)
MIN_SLOT = 64 << 10  # the smallest data slot, bytes
_SEQ, _NBYTES, _OFFSETS = 0, 1, 2  # header words: the call's number, the bytes sent, then ranks + 1 offsets
_STATES: dict[str, _State | None] = {}  # a group's slots by its key; None: none could be made (the library's)


class _Set:
    """One of the two alternating sets of slots: headers (fixed size) and data (grown on need)."""

    def __init__(self, g: shm.ShmGroup, name: str) -> None:
        self.heads = g.slots(f"a2a-head-{name}", g.size + 1 + _OFFSETS, torch.int64)
        self.views = [h.numpy() for h in self.heads]  # a look at a few words: numpy costs ~1 us, torch ~6
        self.name = name
        self.data: list[torch.Tensor] = []
        self.capacity = 0  # bytes per data slot (the same on every rank)

    def grow(self, g: shm.ShmGroup, nbytes: int) -> None:
        """New data slots of GROW x `nbytes` (every rank calls it at the same call, with the same need)."""
        cap = max(int(nbytes * GROW), MIN_SLOT)
        self.data = list(g.slots(f"a2a-data-{self.name}", cap, torch.uint8))  # ShmUnavailable on every rank
        self.capacity = cap


class _State:
    """A group's slot sets, whose turn it is, how many calls it made, and the size no segment could be made for."""

    def __init__(self, g: shm.ShmGroup) -> None:
        self.sets = [_Set(g, "a"), _Set(g, "b")]
        self.turn = 0
        self.calls = 0
        self.failed_at: int | None = None  # a need at least this large falls back to the library (every rank)


def _state(g: shm.ShmGroup) -> _State | None:
    """The slots of `g` (made on its first all_to_all), or None when they could not be made (on every rank)."""
    if g.key in _STATES:
        s = _STATES[g.key]
        if s is None or s.sets[0].heads.group is g:
            return s
    try:
        s = _State(g)
    except shm.ShmUnavailable:
        s = None
    _STATES[g.key] = s
    return s


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous `t`, flat."""
    return t.reshape(-1).view(torch.uint8)


class Exchange:
    """An all_to_all that this rank has written and flagged (`start`); `wait()` waits for the others and returns
    the rows received, in `out` (allocated at the start unless given, not to be read before). Holds its operand until
    then."""

    def __init__(self, g: shm.ShmGroup, group: Any, x: torch.Tensor, in_splits: Sequence[int],
                 out_splits: Sequence[int], state: _State | None, out: torch.Tensor | None = None) -> None:
        self.g, self.group, self.x, self.state = g, group, x, state
        self.in_splits, self.out_splits = list(in_splits), list(out_splits)
        shape = (sum(self.out_splits), *x.shape[1:])
        if out is not None and (tuple(out.shape) != shape or not out.is_contiguous() or out.dtype != x.dtype):
            raise BackendError(f"shared-memory all_to_all of ranks {g.ranks}: its receive buffer must be contiguous "
                               f"{x.dtype} of shape {shape}, got {out.dtype} {tuple(out.shape)}")
        self.out = x.new_empty(shape) if out is None else out  # the receive buffer: filled by `wait`
        self.done = False
        if state is None:  # no slots: the library's call, at the wait
            return
        self.row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row
        self.offsets = [0]
        for n in self.in_splits:
            self.offsets.append(self.offsets[-1] + n * self.row)
        self.use = state.sets[state.turn]
        state.turn ^= 1
        state.calls += 1
        self.seq = state.calls
        need = self.offsets[-1]
        if need <= self.use.capacity:  # else every rank writes at the wait, once the slots have grown
            self._write()
        head = self.use.views[g.me]
        head[_SEQ], head[_NBYTES] = self.seq, need
        head[_OFFSETS:_OFFSETS + g.size + 1] = self.offsets
        self.epoch = g.arrive()

    def _write(self) -> None:
        """This rank's rows for the other ranks into its data slot (its own rows are read from `x` itself)."""
        me, src, slot = self.g.me, _bytes(self.x), self.use.data[self.g.me] if self.use.data else None
        a, b = self.offsets[me], self.offsets[me + 1]
        if slot is not None:
            if a:
                slot[:a].copy_(src[:a])
            if self.offsets[-1] > b:
                slot[b:self.offsets[-1]].copy_(src[b:self.offsets[-1]])

    def wait(self) -> torch.Tensor:
        """The rows received: out_splits[j] rows from rank j, in rank order (waits for every rank's start)."""
        if self.done:
            return self.out
        if self.state is None:
            return self._library()
        g, use = self.g, self.use
        g.wait(self.epoch)
        heads = [v.tolist() for v in use.views]
        for j, h in enumerate(heads):
            if h[_SEQ] != self.seq:
                raise BackendError(f"rank {dist.get_rank()}: rank {g.ranks[j]} is at shared-memory all_to_all call "
                                   f"{h[_SEQ]} of ranks {g.ranks} while this rank is at call {self.seq}: the ranks "
                                   "do not make the same calls in the same order")
        need = max(h[_NBYTES] for h in heads)
        if need > use.capacity:
            if self.state.failed_at is not None and need >= self.state.failed_at:
                return self._library()
            try:
                use.grow(g, need)
            except shm.ShmUnavailable:
                self.state.failed_at = need
                return self._library()
            self._write()
            g.barrier()
        src, row = _bytes(self.x), self.row
        dst, at = _bytes(self.out), 0
        for j, h in enumerate(heads):
            n = self.out_splits[j] * row
            a, b = h[_OFFSETS + g.me], h[_OFFSETS + g.me + 1]
            if b - a != n:
                raise BackendError(f"rank {dist.get_rank()}: rank {g.ranks[j]} sends it {b - a} bytes in a "
                                   f"shared-memory all_to_all but it expects {n} ({self.out_splits[j]} rows of "
                                   f"{row} bytes): the ranks' splits disagree")
            if n:
                dst[at:at + n].copy_(src[a:b] if j == g.me else use.data[j][a:b])
            at += n
        self.done, self.x = True, None
        return self.out

    def _library(self) -> torch.Tensor:
        """The call through torch.distributed's all_to_all_single (no segment could hold it)."""
        dist.all_to_all_single(self.out, self.x, self.out_splits, self.in_splits, group=self.group)
        self.done, self.x = True, None
        return self.out


def start(g: shm.ShmGroup, group: Any, x: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int],
          out: torch.Tensor | None = None) -> Exchange:
    """Begin the all_to_all of `x`'s rows over shared-memory group `g` (of torch.distributed group `group`): the
    first in_splits[0] rows to group rank 0, the next in_splits[1] to rank 1, ...; out_splits[j] rows come from
    rank j. `.wait()` returns them (in `out` when given: contiguous, x's dtype, sum(out_splits) rows); compute
    between the two while the other ranks arrive."""
    if len(in_splits) != g.size or len(out_splits) != g.size:
        raise BackendError(f"shared-memory all_to_all of ranks {g.ranks}: {len(in_splits)} input and "
                           f"{len(out_splits)} output splits for {g.size} ranks")
    if x.dim() == 0 or sum(in_splits) != x.shape[0]:
        raise BackendError(f"shared-memory all_to_all of ranks {g.ranks}: the input splits sum to {sum(in_splits)} "
                           f"rows but the input has shape {tuple(x.shape)}")
    return Exchange(g, group, x.detach().contiguous(), in_splits, out_splits, _state(g), out)


def all_to_all(g: shm.ShmGroup, group: Any, x: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int]
               ) -> torch.Tensor:
    """`start(...).wait()`: torch.distributed.all_to_all_single(out, x, out_splits, in_splits) through shared
    memory."""
    return start(g, group, x, in_splits, out_splits).wait()


__all__ = ["Exchange", "all_to_all", "start"]
