"""Collectives priced on their own group: its size, and the link it spans (NVLink inside a node; the node's
InfiniBand / RoCE / EFA rails across). The library's call (NCCL) runs ring or tree, whichever is faster for the
message, as NCCL's tuner picks: the algorithms and their formulas are the collectives table's registrations, priced by
`collectives/pricing.py` (alpha-beta: a ring all-reduce of n bytes over g ranks takes 2 (g - 1) alpha +
2 (g - 1) / g x n / B, all-gather and reduce-scatter half of it; a double binary tree 2 log2(g) alpha + 2 n / B)."""

from __future__ import annotations

from cocoweave.cluster.planning.llm.system import System
from cocoweave.collectives import DEFAULT
from cocoweave.collectives.pricing import Link, fastest, known, seconds, spread_seconds
from cocoweave.errors import PlanningError

__all__ = ["Link", "all_to_all_s", "collective_s", "group_link", "priced"]

P2P_KINDS = ("p2p", "send", "recv")


def group_link(system: System, size: int, stride: int) -> Link | None:
    """The link a group of `size` ranks, `stride` ranks apart, spans (None for one rank). A group spread over nodes
    with r members per node drives r NIC rails at once (NCCL runs one ring per rail), up to the NVLink rate."""
    if size <= 1:
        return None
    per_node = system.gpus_per_node
    intra = system.intra
    if size * stride <= per_node:
        if intra is None:
            raise PlanningError(f"machine {system.machine.name} names no intra_node network for a group of {size}.")
        return _intra(system)
    inter = system.inter
    if inter is None:
        raise PlanningError(f"machine {system.machine.name} names no inter_node network for a group across nodes.")
    link = _inter(system, ranks_per_node(size, stride, per_node))
    if intra is None:
        return link
    return Link(link.name, min(link.bandwidth, _intra(system).bandwidth), link.latency)


def ranks_per_node(size: int, stride: int, per_node: int) -> int:
    """Members of a group of `size` ranks, `stride` apart, that share a node of `per_node` GPUs (at least 1)."""
    return max(1, min(size, per_node // stride)) if stride < per_node else 1


def _intra(system: System) -> Link:
    """The node's own link at the stack's achieved fraction."""
    intra = system.intra
    return Link.of(intra.key, intra.bandwidth_gb_s, intra.latency_us, system.eff.intra)


def _inter(system: System, rails: int = 1) -> Link:
    """`rails` NIC rails driven at once (one by default) at the stack's achieved fraction."""
    inter = system.inter
    return Link.of(inter.key, inter.bandwidth_gb_s, inter.latency_us, system.eff.inter, rails)


def priced(kind: str, nbytes: float, size: int, link: Link | None, algorithm: str = DEFAULT) -> tuple[float, str]:
    """Seconds for one collective of `nbytes` (the full, unsharded tensor) over `size` ranks on `link`, and the
    algorithm priced ("ring" for the library's own, "tree", "p2p" or "none"). `algorithm`: the call priced (the
    library's, which picks among its registered variants; another registered algorithm prices its own formula)."""
    if link is None or size <= 1 or nbytes <= 0:
        return 0.0, "none"
    if not known(kind):
        raise PlanningError(f"unknown collective {kind!r}.")
    if algorithm != DEFAULT:
        return seconds(kind, nbytes, size, link, algorithm), algorithm
    t, name = fastest(kind, nbytes, size, link)
    if name != DEFAULT:
        return t, name
    return t, "p2p" if kind in P2P_KINDS else "ring"


def collective_s(kind: str, nbytes: float, size: int, link: Link | None, algorithm: str = DEFAULT) -> float:
    """Seconds for one collective (see `priced`)."""
    return priced(kind, nbytes, size, link, algorithm)[0]


def all_to_all_s(nbytes: float, size: int, stride: int, system: System) -> float:
    """Seconds of one all-to-all in which each of `size` ranks, `stride` apart, holds `nbytes` and sends 1/size of
    them to every other rank (the bytes and message steps of the table's all_to_all: (size - 1) / size of them in
    size - 1 steps, NCCL's size - 1 concurrent send/recv pairs). Peers on the same node are reached over NVLink, the
    others through the rank's own NIC rail, both at once: the slower of the two, plus one latency per step
    (`pricing.spread_seconds`)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    per_node = system.gpus_per_node
    local = ranks_per_node(size, stride, per_node)
    if local < size and system.inter is None or local > 1 and system.intra is None:
        raise PlanningError(f"machine {system.machine.name} names no network for an all-to-all over {size} ranks.")
    near = _intra(system) if local > 1 else None
    far = _inter(system) if local < size else None
    return spread_seconds("all_to_all", nbytes, size, near, local, far)
