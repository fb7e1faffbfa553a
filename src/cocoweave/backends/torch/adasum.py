"""Adasum all-reduce over point-to-point messages: vector-halving, distance-doubling (VHDD), as in Horovod.

Pairing, for a group of n = 2^k + e ranks (0 <= e < 2^k), the same in the reference backend
(`backends.adasum.adasum_survivors` / `adasum_tree`), so both combine in exactly the same order:

1. Fold: for i < e, rank 2i+1 sends its whole tensor to rank 2i, which replaces its own with
   adasum(r_2i, r_2i+1). The 2^k survivors, in rank order, are s_0 .. s_{2^k-1}
   (ranks 0, 2, .., 2e-2, then 2e, 2e+1, .., n-1). With n a power of two nothing folds.
2. Reduce (vector halving, distance doubling): at level l = 0 .. k-1, survivor s pairs with s XOR 2^l.
   Both hold the same segment of the vector (the whole vector at level 0); the lower survivor keeps its
   first half (the shorter one when the length is odd), the upper one the second half, and each sends
   the other half to its partner. `a` is the lower group's partial result, `b` the upper group's. The
   float64 triples [a·b, |a|^2, |b|^2] of the pieces are summed over the 2^(l+1) survivors that hold
   the pieces of this pair of groups (recursive doubling over P2P: s exchanges with s XOR 2^j for
   j = 0 .. l, adding lower + upper so every survivor gets the same bits), giving whole-tensor
   coefficients; each survivor then writes ca·a + cb·b (float64, rounded once to the tensor's dtype)
   into its piece. The result is adasum(adasum(s_0, s_1), adasum(s_2, s_3)) ...: a balanced tree
   over the survivors, Horovod's order when n is a power of two.
3. Gather (distance halving): the levels in reverse, partners exchange their finished pieces.
4. Unfold: rank 2i sends the result to rank 2i+1.

The bulk traffic is that of a ring all-reduce (about 2(1 - 1/2^k) of the tensor per survivor, plus
twice the tensor for each folded pair); the triples are k(k+1)/2 messages of 24 bytes. No sub-groups are
created (dist.new_group is collective over the whole world, which a pipeline stage's group cannot
demand), so any process group works. With Gloo the messages travel through host memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..adasum import adasum_coefficients, adasum_survivors

_DATA_TAG = 0xADA0  # pieces of the vector
_TRIPLE_TAG = 0xADA1  # [a·b, |a|^2, |b|^2] partial sums
_BLOCK = 1 << 16  # on CPUs the float64 arithmetic runs in blocks of this many elements (cache-sized temporaries)


class _Group:
    """This rank's place in `group`: its index, the global ranks, where messages live, P2P helpers."""

    def __init__(self, group: Any, like: torch.Tensor):
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.group, self.ranks, self.me = group, ranks, dist.get_rank(group)
        nccl = "nccl" in str(dist.get_backend(group))
        self.device = like.device if like.device.type == "cuda" and nccl else torch.device("cpu")

    def exchange(self, peer: int, send: torch.Tensor | None, recv: torch.Tensor | None, tag: int) -> None:
        """Send `send` to and receive `recv` from group rank `peer` (either may be None or empty: skipped)."""
        ops = []
        if send is not None and send.numel():
            ops.append(dist.P2POp(dist.isend, send, self.ranks[peer], self.group, tag))
        if recv is not None and recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self.ranks[peer], self.group, tag))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def adasum_all_reduce(x: torch.Tensor, group: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Adasum of the tensors `x` of every rank of `group` (None: the world), returned on every rank
    (in `out` when given: a contiguous tensor of x's shape and dtype on x's device)."""
    g = _Group(group, x)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if len(g.ranks) == 1:
        return out.copy_(x)
    work = out if out.device == g.device else torch.empty(x.shape, dtype=x.dtype, device=g.device)
    buf = work.view(-1)
    buf.copy_(x.reshape(-1))
    _vhdd(g, buf)
    if work is not out:
        out.copy_(work)
    return out


def _vhdd(g: _Group, buf: torch.Tensor) -> None:
    """In place: `buf` (this rank's flat tensor, on the wire device) becomes the group's adasum."""
    survivors = adasum_survivors(len(g.ranks))
    s = next(i for i, members in enumerate(survivors) if g.me in members)
    members = survivors[s]
    if len(members) == 2 and g.me == members[1]:  # folded: hand the tensor over, get the result back
        g.exchange(members[0], buf, None, _DATA_TAG)
        g.exchange(members[0], None, buf, _DATA_TAG)
        return
    if len(members) == 2:
        other = torch.empty_like(buf)
        g.exchange(members[1], None, other, _DATA_TAG)
        _combine(buf, other, _triple(buf, other), buf)
    peer = [m[0] for m in survivors]  # survivor index -> group rank
    levels: list[tuple[int, int, int, int]] = []  # (lo, mid, hi, partner) of each level
    lo, hi = 0, buf.numel()
    for level in range((len(survivors) - 1).bit_length()):
        partner = s ^ (1 << level)
        lower = s < partner
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        theirs = torch.empty(keep[1] - keep[0], dtype=buf.dtype, device=buf.device)
        g.exchange(peer[partner], buf[give[0]:give[1]], theirs, _DATA_TAG)
        mine = buf[keep[0]:keep[1]]
        a, b = (mine, theirs) if lower else (theirs, mine)
        _combine(a, b, _sum_over(g, peer, s, level, _triple(a, b)), mine)
        levels.append((lo, mid, hi, partner))
        lo, hi = keep
    for lo, mid, hi, partner in reversed(levels):  # distance halving: gather the finished pieces
        keep, give = ((lo, mid), (mid, hi)) if s < partner else ((mid, hi), (lo, mid))
        g.exchange(peer[partner], buf[keep[0]:keep[1]], buf[give[0]:give[1]], _DATA_TAG)
    if len(members) == 2:
        g.exchange(members[1], buf, None, _DATA_TAG)


def _sum_over(g: _Group, peer: list[int], s: int, level: int, triple: torch.Tensor) -> torch.Tensor:
    """Sum `triple` over the 2^(level+1) survivors that share s's bits above `level` (recursive doubling;
    each step adds lower + upper, so every survivor ends with bitwise the same sums)."""
    acc = triple.to(g.device)
    for j in range(level + 1):
        partner = s ^ (1 << j)
        theirs = torch.empty_like(acc)
        g.exchange(peer[partner], acc, theirs, _TRIPLE_TAG)
        acc = acc + theirs if s < partner else theirs + acc
    return acc


def _blocks(a: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """Block bounds over flat tensor `a` (one block on GPUs) and two float64 scratch blocks."""
    n = a.numel()
    step = max(1, n if a.device.type == "cuda" else min(n, _BLOCK))
    scratch = [torch.empty(step, dtype=torch.float64, device=a.device) for _ in range(2)]
    return [(i, min(i + step, n)) for i in range(0, n, step)], scratch[0], scratch[1]


def _triple(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[a·b, |a|^2, |b|^2] of two flat tensors, accumulated in float64 block by block."""
    bounds, a64, b64 = _blocks(a)
    parts = [torch.zeros(3, dtype=torch.float64, device=a.device)]
    for lo, hi in bounds:
        x, y = a64[:hi - lo].copy_(a[lo:hi]), b64[:hi - lo].copy_(b[lo:hi])
        parts.append(torch.stack([torch.dot(x, y), torch.dot(x, x), torch.dot(y, y)]))
    return parts[-1] if len(parts) == 2 else torch.stack(parts).sum(0)


def _combine(a: torch.Tensor, b: torch.Tensor, triple: torch.Tensor, out: torch.Tensor) -> None:
    """out = ca * a + cb * b with adasum's coefficients from `triple`: the reference's arithmetic
    (float64 products and sum, rounded once to out's dtype), block by block; `out` may be a or b."""
    ca, cb = adasum_coefficients(triple)  # 0-dim tensors where the data is: no host sync per level
    bounds, a64, b64 = _blocks(a)
    for lo, hi in bounds:
        x, y = a64[:hi - lo].copy_(a[lo:hi]), b64[:hi - lo].copy_(b[lo:hi])
        out[lo:hi].copy_(x.mul_(ca).add_(y.mul_(cb)))
