"""What a collective moves: the fraction of its tensor each rank sends, and its message steps, at p ranks.

Bandwidth-optimal collectives (a ring, or the library's NCCL/Gloo call): an all-reduce moves 2(p-1)/p of the
tensor per rank in 2(p-1) steps, a reduce-scatter or all-gather (p-1)/p in p-1 steps, a broadcast or reduce the
whole tensor in log2(p) steps (a tree), an all-to-all (p-1)/p of the rank's part in p-1 pairwise steps, a
point-to-point message the whole tensor in one (the receiving side moves nothing). The cost model, calibration
and the cluster's step scaling all read these; this is their one home.
"""

from __future__ import annotations

import math

from ..errors import CocoweaveError
from .kinds import find

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "p2p", "send", "recv")


def moved(kind: str, p: int) -> float:
    """Fraction of the tensor one rank moves in collective `kind` over p ranks (bandwidth-optimal algorithm); for
    all_to_all the tensor is the rank's part, which it keeps 1/p of."""
    if kind == "all_reduce":
        return 2 * (p - 1) / p
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
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
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return p - 1
    if kind in ("broadcast", "reduce"):
        return math.ceil(math.log2(p)) if p > 1 else 0
    if kind in ("p2p", "send", "recv"):
        return 1 if p > 1 else 0
    if (k := find(kind)) is not None and k.steps is not None:
        return k.steps(p)
    raise CocoweaveError(f"unknown collective {kind!r}: the traffic of {', '.join(KINDS)} is known")
