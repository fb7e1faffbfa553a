"""Collectives priced on their own group: its size, and the link it spans (NVLink inside a node; the node's
InfiniBand / RoCE / EFA rails across). Ring or tree, whichever is faster for the message, as NCCL's tuner picks.

alpha-beta model (Thakur et al. 2005; NCCL's "bus bandwidth", nccl-tests/doc/PERFORMANCE.md): a ring all-reduce of
n bytes over g ranks takes 2 (g - 1) alpha + 2 (g - 1) / g x n / B; all-gather and reduce-scatter half of it; a
double-binary-tree all-reduce 2 log2(g) alpha + 2 n / B (pipelined, bandwidth-optimal only for large g)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cocoweave.cluster.planning.llm.system import System
from cocoweave.cluster.profiling.host_scaling import TRAFFIC
from cocoweave.errors import PlanningError


@dataclass(frozen=True)
class Link:
    """What a group's traffic crosses: bandwidth per GPU (bytes/s, achieved) and per-step latency (s)."""

    name: str
    bandwidth: float
    latency: float


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
        return Link(intra.key, intra.bandwidth_gb_s * 1e9 * system.eff.intra, intra.latency_us * 1e-6)
    inter = system.inter
    if inter is None:
        raise PlanningError(f"machine {system.machine.name} names no inter_node network for a group across nodes.")
    rails = max(1, min(size, per_node // stride)) if stride < per_node else 1
    bandwidth = rails * inter.bandwidth_gb_s * 1e9 * system.eff.inter
    if intra is not None:
        bandwidth = min(bandwidth, intra.bandwidth_gb_s * 1e9 * system.eff.intra)
    return Link(inter.key, bandwidth, inter.latency_us * 1e-6)


def priced(kind: str, nbytes: float, size: int, link: Link | None) -> tuple[float, str]:
    """Seconds for one collective of `nbytes` (the full, unsharded tensor) over `size` ranks on `link`, and the
    algorithm priced ("ring", "tree", "p2p" or "none")."""
    if link is None or size <= 1 or nbytes <= 0:
        return 0.0, "none"
    if kind not in TRAFFIC:
        raise PlanningError(f"unknown collective {kind!r}.")
    g, a, bw = size, link.latency, link.bandwidth
    moved, hops = TRAFFIC[kind]  # the ring's (or one message's) share of the tensor and its steps
    ring = hops(g) * a + moved(g) * nbytes / bw
    if kind != "all_reduce":
        return ring, "p2p" if kind in ("p2p", "send", "recv") else "ring"
    tree = 2 * math.ceil(math.log2(g)) * a + 2 * nbytes / bw
    return (ring, "ring") if ring <= tree else (tree, "tree")


def collective_s(kind: str, nbytes: float, size: int, link: Link | None) -> float:
    """Seconds for one collective (see `priced`)."""
    return priced(kind, nbytes, size, link)[0]


def all_to_all_s(nbytes: float, size: int, stride: int, system: System) -> float:
    """Seconds of one all-to-all in which each of `size` ranks, `stride` apart, holds `nbytes` and sends 1/size of
    them to every other rank (the bytes and message steps of `collectives/traffic.py`'s all_to_all: (size - 1) /
    size of them in size - 1 steps, NCCL's size - 1 concurrent send/recv pairs). Peers on the same node are reached
    over NVLink, the others through the rank's own NIC rail, both at once: the slower of the two, plus one latency
    per step."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    moved, hops = TRAFFIC["all_to_all"]
    per_node = system.gpus_per_node
    local = max(1, min(size, per_node // stride)) if stride < per_node else 1
    if local < size and system.inter is None or local > 1 and system.intra is None:
        raise PlanningError(f"machine {system.machine.name} names no network for an all-to-all over {size} ranks.")
    sent = moved(size) * nbytes  # split between the peers on this node (local - 1) and the others (size - local)
    intra = sent * (local - 1) / (size - 1) / (system.intra.bandwidth_gb_s * 1e9 * system.eff.intra) \
        if local > 1 else 0.0
    inter = sent * (size - local) / (size - 1) / (system.inter.bandwidth_gb_s * 1e9 * system.eff.inter) \
        if local < size else 0.0
    link = system.inter if local < size else system.intra
    return hops(size) * link.latency_us * 1e-6 + max(intra, inter)
