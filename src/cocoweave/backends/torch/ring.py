"""Ring collectives over point-to-point messages, and CoCoNet's fused ReduceScatter + computation + AllGather.

Every rank of the group calls the same function with tensors of the same shape. Parts follow
`torch.tensor_split` along `dim` (rank r owns part r; sizes may differ by one, and may be zero), or are in
proportion to `shares` when given (uneven parts: the messages of a step then differ in size).

A ring collective over p ranks runs p-1 steps; in each step rank r sends one chunk to r+1 and receives
one from r-1 (`dist.batch_isend_irecv`). Each ring is written as a generator that yields the P2P ops
of one step and is resumed once they completed, so several rings can advance step by step in one loop
(`fused_ring` interleaves the all-gathers of one piece with the reduce-scatter of the next).

Gloo sends from host memory only, so with Gloo the messages travel through CPU buffers even for CUDA
tensors; only NCCL sends device memory directly. Under NCCL every rank first joins the group's communicator
with one small all-reduce (a rank with empty chunks would otherwise skip the first batch_isend_irecv).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import BackendError
from ...ir.layout import share_bounds, slice_bounds
from . import placement

OPS = ("sum", "avg", "max", "min")
_HALF = (torch.float16, torch.bfloat16)
_RS_TAG = 0  # reduce-scatter rings
_AG_TAG = 1  # the all-gather ring of output i uses tag _AG_TAG + i

Steps = Generator[list[dist.P2POp], None, None]
Bounds = list[tuple[int, int]]


class _Ring:
    """Drives one ring: each `yield` of `steps` hands over a step's P2P ops, resumed once they completed."""

    def __init__(self, steps: Steps):
        self._steps = steps
        self._works: list[Any] = []
        self.done = False
        self._post()

    def _post(self) -> None:
        # Resuming the generator runs the local work of the step that just completed (a reduction, a
        # copy) and then posts the next step's sends and receives, which return at once.
        try:
            ops = next(self._steps)
        except StopIteration:
            self.done = True
            return
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def advance(self) -> None:
        """Wait for the step in flight, then do its local work and post the next step."""
        for work in self._works:
            work.wait()
        self._post()


def _drive(*rings: _Ring) -> None:
    while not all(r.done for r in rings):
        for r in rings:
            if not r.done:
                r.advance()


class _Peers:
    """This rank's place in the ring of `group`: index, size, and the global ranks of its neighbours."""

    def __init__(self, group: dist.ProcessGroup | None):
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.group, self.size, self.me = group, len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.me + 1) % self.size], ranks[(self.me - 1) % self.size]
        self._nccl = "nccl" in str(dist.get_backend(group))
        if self._nccl:
            _join_communicator(group)

    def wire_device(self, t: torch.Tensor) -> torch.device:
        """Where messages of `t`'s data live: the tensor's device under NCCL, else host memory (Gloo)."""
        return t.device if t.device.type == "cuda" and self._nccl else torch.device("cpu")

    def ops(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list[dist.P2POp]:
        """Send `send` to the next rank, receive `recv` from the previous one; empty chunks are skipped
        (both ends of a message know its size, so they skip it together)."""
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        return ops


_JOINED: set[int] = set()  # ids of the groups whose NCCL communicator this process has joined


def _join_communicator(group: dist.ProcessGroup | None) -> None:
    """Join the group's NCCL communicator with every rank once, by a one-element all-reduce: torch requires all
    ranks in a group's first batch_isend_irecv, and a rank whose chunks are empty posts no message at all."""
    key = id(group if group is not None else dist.group.WORLD)
    if key not in _JOINED:
        dist.all_reduce(torch.zeros(1, device=placement.compute_device()), group=group)
        _JOINED.add(key)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise BackendError(f"ring collectives reduce with one of {', '.join(OPS)}, got {op!r}")


def _combine(op: str, acc: torch.Tensor, own: torch.Tensor) -> None:
    """acc <- acc (op) own, in acc's dtype and on acc's device."""
    own = own.to(acc.device, acc.dtype)
    if op in ("sum", "avg"):
        acc.add_(own)
    elif op == "max":
        torch.maximum(acc, own, out=acc)
    else:
        torch.minimum(acc, own, out=acc)


def _reduce_scatter_steps(peers: _Peers, x_t: torch.Tensor, bounds: Bounds, op: str, result_t: torch.Tensor,
                          tag: int) -> Steps:
    """Ring reduce-scatter of chunk c = x_t[bounds[c]] (dim moved to 0) over the ranks; the reduced chunk
    of this rank lands in `result_t`.

    At step k rank r sends its partial sum of chunk (r-k-1) and receives the partial sum of chunk (r-k-2),
    to which it adds its own contribution: after p-1 steps it holds chunk r summed over all ranks. The
    order of summation of chunk c is fixed (rank c+1 first, rank c last), so results are deterministic.
    """
    p, me = peers.size, peers.me
    dtype = torch.float32 if x_t.dtype in _HALF else x_t.dtype  # half partial sums travel as float32
    longest = max(stop - start for start, stop in bounds)
    bufs = [torch.empty((longest, *x_t.shape[1:]), dtype=dtype, device=peers.wire_device(x_t))
            for _ in range(min(p, 2))]

    def own(c: int) -> torch.Tensor:
        return x_t[bounds[c][0]:bounds[c][1]]

    c = (me - 1) % p
    acc = bufs[0][:len(own(c))]
    acc.copy_(own(c))
    for k in range(p - 1):
        c = (me - k - 2) % p
        inbox = bufs[(k + 1) % 2][:len(own(c))]  # never the buffer being sent in this step
        yield peers.ops(acc, inbox, tag)
        _combine(op, inbox, own(c))
        acc = inbox
    if op == "avg":
        acc.div_(p)
    result_t.copy_(acc)


def _all_gather_steps(peers: _Peers, mine: torch.Tensor, out_t: torch.Tensor, bounds: Bounds, tag: int) -> Steps:
    """Ring all-gather: chunk c (`mine` on rank c) lands in out_t[bounds[c]] (dim moved to 0) on every rank.

    At step k rank r forwards chunk (r-k) and receives chunk (r-k-1). Chunks are received straight into
    `out_t` when it is contiguous in host/wire memory, else into two alternating staging buffers."""
    p, me = peers.size, peers.me
    start, stop = bounds[me]
    out_t[start:stop].copy_(mine)
    wire = peers.wire_device(out_t)
    direct = out_t.is_contiguous() and out_t.device == wire
    send = out_t[start:stop] if direct else mine.to(wire, out_t.dtype).contiguous()
    if not direct:
        longest = max(b - a for a, b in bounds)
        staging = [torch.empty((longest, *out_t.shape[1:]), dtype=out_t.dtype, device=wire)
                   for _ in range(min(p - 1, 2))]
    for k in range(p - 1):
        start, stop = bounds[(me - k - 1) % p]
        inbox = out_t[start:stop] if direct else staging[k % 2][:stop - start]
        yield peers.ops(send, inbox, tag)
        if not direct:
            out_t[start:stop].copy_(inbox)
        send = inbox


def parts(size: int, p: int, shares: Sequence[int] | None = None) -> Bounds:
    """[start, stop) of each of p ranks' parts of `size`: tensor_split sizes, or in proportion to `shares`."""
    return [share_bounds(size, tuple(shares) if shares is not None else p, r) for r in range(p)]


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != expected:
        raise BackendError(f"{name} has shape {tuple(t.shape)}, expected {expected} ({why})")


def with_dim(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    """`shape` with its size along `dim` replaced by `size`."""
    return tuple(size if i == dim else s for i, s in enumerate(shape))


def ring_reduce_scatter(x: torch.Tensor, dim: int, op: str, group: dist.ProcessGroup | None,
                        out: torch.Tensor, shares: Sequence[int] | None = None) -> None:
    """Reduce this rank's full-shape `x` over the group with `op`; `out` receives this rank's part (along `dim`,
    torch.tensor_split sizes) of the result. Half inputs are accumulated in float32."""
    _check_op(op)
    peers = _Peers(group)
    dim = dim % x.dim()
    bounds = parts(x.shape[dim], peers.size, shares)
    start, stop = bounds[peers.me]
    _check_shape("ring_reduce_scatter's out", out, with_dim(x.shape, dim, stop - start), f"part {peers.me} of x")
    _drive(_Ring(_reduce_scatter_steps(peers, x.movedim(dim, 0), bounds, op, out.movedim(dim, 0), _RS_TAG)))


def ring_all_gather(part: torch.Tensor, dim: int, group: dist.ProcessGroup | None, out: torch.Tensor,
                    shares: Sequence[int] | None = None) -> None:
    """Gather every rank's `part` into the full-shape `out`, part r at its torch.tensor_split position along `dim`."""
    peers = _Peers(group)
    dim = dim % out.dim()
    bounds = parts(out.shape[dim], peers.size, shares)
    start, stop = bounds[peers.me]
    _check_shape("ring_all_gather's part", part, with_dim(out.shape, dim, stop - start),
                 f"part {peers.me} of out")
    _drive(_Ring(_all_gather_steps(peers, part.movedim(dim, 0), out.movedim(dim, 0), bounds, _AG_TAG)))


def fused_ring(x: torch.Tensor, dim: int, op: str, group: dist.ProcessGroup | None,
               compute: Callable[[torch.Tensor, int, int], list[torch.Tensor]],
               outs: list[torch.Tensor], subchunks: int = 2, shares: Sequence[int] | None = None) -> None:
    """CoCoNet's fused ReduceScatter + computation + AllGather.

    Each rank's part of `x` (along `dim`) is cut into `subchunks` pieces (torch.tensor_split of the part).
    For piece s, a ring reduce-scatter reduces piece s of every rank's part, so each rank holds its own
    piece s reduced; `compute(reduced_piece, offset, length)` (offset and length locate the piece inside
    this rank's part) returns one piece-shaped tensor per output, and a ring all-gather writes each into
    `outs[i]` (full shape along `dim`) at (start of this rank's part + offset). `compute` is not called for
    empty pieces; such ranks still forward the others' data around the rings.
    An output may be `x` itself (in place): piece s is gathered only after every rank has reduced it, and
    the later reduce-scatters read other pieces.

    What overlaps (the P2P transfers run in the backend's threads while this thread works): the
    all-gathers of piece s advance one ring step per step of the reduce-scatter of piece s+1, so their
    transfers share the rounds of that reduce-scatter and overlap its reductions; and the first step of
    piece s+1's reduce-scatter is posted before compute(s) runs, so it travels during the computation.
    Later steps of a ring need this thread (a reduction, a forward), so they do not progress during
    compute. Everything has completed when the function returns.
    """
    _check_op(op)
    if subchunks < 1:
        raise BackendError(f"fused_ring needs subchunks >= 1, got {subchunks}")
    peers = _Peers(group)
    p, me = peers.size, peers.me
    dim = dim % x.dim()
    size = x.shape[dim]
    for i, o in enumerate(outs):
        if o.dim() != x.dim() or o.shape[dim] != size:
            raise BackendError(f"fused_ring's outs[{i}] has shape {tuple(o.shape)}; it must have {x.dim()} "
                               f"dimensions and size {size} along dim {dim} like x")
    rank_parts = parts(size, p, shares)
    x_t, outs_t = x.movedim(dim, 0), [o.movedim(dim, 0) for o in outs]

    def piece_bounds(s: int) -> Bounds:
        """Global bounds of piece s of every rank's part."""
        return [(a + lo, a + hi) for a, b in rank_parts for lo, hi in [slice_bounds(b - a, subchunks, s)]]

    def start_reduce_scatter(s: int) -> tuple[torch.Tensor, _Ring]:
        bounds = piece_bounds(s)
        lo, hi = bounds[me]
        reduced = torch.empty(with_dim(x.shape, dim, hi - lo), dtype=x.dtype, device=x.device)
        return reduced, _Ring(_reduce_scatter_steps(peers, x_t, bounds, op, reduced.movedim(dim, 0), _RS_TAG))

    gathers: list[_Ring] = []
    reduced, rs = start_reduce_scatter(0)
    for s in range(subchunks):
        # Finish piece s's reduce-scatter; the all-gathers of piece s-1 move one step per round with it.
        while not rs.done:
            rs.advance()
            for g in gathers:
                g.advance()
            gathers = [g for g in gathers if not g.done]
        piece = reduced
        if s + 1 < subchunks:
            reduced, rs = start_reduce_scatter(s + 1)  # its first step is in flight during compute(s)
        bounds = piece_bounds(s)
        lo, hi = bounds[me]
        offset = lo - rank_parts[me][0]
        if hi > lo:
            results = compute(piece, offset, hi - lo)
            if len(results) != len(outs):
                raise BackendError(f"fused_ring's compute returned {len(results)} tensors for {len(outs)} outputs")
            for i, (res, o) in enumerate(zip(results, outs)):
                _check_shape(f"compute's result {i}", res, with_dim(o.shape, dim, hi - lo),
                             f"piece of outs[{i}] at offset {offset}")
            mine = [res.movedim(dim, 0) for res in results]
        else:
            mine = [o[lo:hi] for o in outs_t]
        gathers += [_Ring(_all_gather_steps(peers, m, o, bounds, _AG_TAG + i))
                    for i, (m, o) in enumerate(zip(mine, outs_t))]
    _drive(*gathers)
