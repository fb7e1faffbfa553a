"""What a collective moves: the fraction of its tensor each rank sends, and its message steps, at p ranks.

Bandwidth-optimal collectives (a ring, or the library's NCCL/Gloo call): an all-reduce moves 2(p-1)/p of the
tensor per rank in 2(p-1) steps, a reduce-scatter or all-gather (p-1)/p in p-1 steps, a broadcast or reduce the
whole tensor in log2(p) steps (a tree), an all-to-all (p-1)/p of the rank's part in p-1 pairwise steps, a
point-to-point message the whole tensor in one (the receiving side moves nothing). NCCL's double binary tree
all-reduce (`tree_moved`, `tree_steps`) moves twice the tensor in 2 log2(p) steps. The algorithms' registrations
name these (collectives/algorithms.py) and collectives/pricing.py turns them into seconds; this is their one home.
"""

from __future__ import annotations

import math

from ..errors import CocoweaveError
from .kinds import find

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_v", "broadcast", "reduce", "p2p",
         "send", "recv")
EXCHANGES = ("reduce_scatter", "all_gather", "all_to_all", "all_to_all_v")  # (p-1)/p of the tensor in p-1 steps


def known(kind: str) -> bool:
    """Whether the traffic of collective `kind` is known: one of KINDS, or a registered kind with its own formula."""
    return kind in KINDS or ((k := find(kind)) is not None and k.moved is not None and k.steps is not None)


def moved(kind: str, p: int) -> float:
    """Fraction of the tensor one rank moves in collective `kind` over p ranks (bandwidth-optimal algorithm); for
    all_to_all the tensor is the rank's part, which it keeps 1/p of. An all_to_all_v's splits are runtime values,
    unknown when a schedule is priced: it is priced as the even all_to_all of its operand (every row sent, 1/p of
    them to itself); at run time it moves the rows its splits send the other ranks, at most the operand."""
    if kind == "all_reduce":
        return 2 * (p - 1) / p
    if kind in EXCHANGES:
        return (p - 1) / p
    if kind in ("broadcast", "reduce", "p2p", "send"):
        return 1.0 if p > 1 else 0.0
    if kind == "recv":
        return 0.0
    if (k := find(kind)) is not None and k.moved is not None:  # a registered kind with its own formula
        return k.moved(p)
    raise CocoweaveError(f"unknown collective {kind!r}: the traffic of {', '.join(KINDS)} is known")


def steps(kind: str, p: int) -> int:
    """Message steps one rank takes in collective `kind` over p ranks (ring, tree for broadcast and reduce)."""
    if kind == "all_reduce":
        return 2 * (p - 1)
    if kind in EXCHANGES:
        return p - 1
    if kind in ("broadcast", "reduce"):
        return math.ceil(math.log2(p)) if p > 1 else 0
    if kind in ("p2p", "send", "recv"):
        return 1 if p > 1 else 0
    if (k := find(kind)) is not None and k.steps is not None:
        return k.steps(p)
    raise CocoweaveError(f"unknown collective {kind!r}: the traffic of {', '.join(KINDS)} is known")


def tree_moved(kind: str, p: int) -> float:
    """Fraction of the tensor one rank moves in a double binary tree all-reduce over p ranks (Sanders et al. 2009,
    NCCL's tree): the tensor reduced up one tree and broadcast down, pipelined, twice it whatever p; other
    collectives as `moved`."""
    if kind == "all_reduce":
        return 2.0 if p > 1 else 0.0
    return moved(kind, p)


def tree_steps(kind: str, p: int) -> int:
    """Message steps one rank takes in a double binary tree all-reduce over p ranks: the depth of the tree up and
    down, 2 ceil(log2 p); other collectives as `steps`."""
    if kind == "all_reduce":
        return 2 * math.ceil(math.log2(p)) if p > 1 else 0
    return steps(kind, p)
