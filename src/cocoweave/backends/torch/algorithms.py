"""The torch backend's implementations of the collective algorithms, registered against their table
(cocoweave.collectives): `RankContext` methods by algorithm and operation. Generated code calls each by its name
(`ctx.ring_all_reduce(...)`); `method` is how the code generator finds that name."""

from __future__ import annotations

from ... import collectives
from .runtime import RankContext

BACKEND = "torch"

collectives.implement(BACKEND, "library", all_reduce=RankContext.all_reduce, reduce_scatter=RankContext.reduce_scatter,
                      all_gather=RankContext.all_gather, all_to_all=RankContext.all_to_all,
                      broadcast=RankContext.broadcast, reduce=RankContext.reduce,
                      send=RankContext.send_recv)
collectives.implement(BACKEND, "ring", all_reduce=RankContext.ring_all_reduce,
                      reduce_scatter=RankContext.ring_reduce_scatter, all_gather=RankContext.ring_all_gather,
                      fused=RankContext.fused_ring)
collectives.implement(BACKEND, "shm", all_reduce=RankContext.shm_all_reduce,
                      reduce_scatter=RankContext.shm_reduce_scatter, all_gather=RankContext.shm_all_gather,
                      send=RankContext.shm_send_recv)


def method(algorithm: str, op: str) -> str:
    """The name generated code calls `ctx.<name>(...)` by for `op` on `algorithm`: its registered implementation's
    (a RankContext method, or a function RankContext resolves by that name)."""
    return collectives.implementation(BACKEND, algorithm, op).__name__
