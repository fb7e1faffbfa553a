"""The one pricing model of collectives: seconds for collective `kind` of n bytes over p ranks on a link, on an
algorithm, read from that algorithm's registration (collectives/algorithms.py: its `traffic` and `steps`).

alpha-beta (Hockney; Thakur et al. 2005; NCCL's "bus bandwidth", nccl-tests/doc/PERFORMANCE.md): steps x the link's
latency per message step + the fraction of the tensor a rank moves x n / the link's achieved bandwidth. A ring
all-reduce of n bytes over p ranks: 2 (p - 1) alpha + 2 (p - 1) / p n / B; a double binary tree 2 log2(p) alpha +
2 n / B. The library's call runs whichever of its own algorithm and those registered inside it is faster for the
message (`fastest`: NCCL's tuner choosing ring or tree). The LLM planner, the profiler's hardware model and the
tuner's cost model (whose fitted lines are per call: `latency_scale` carries a line to an algorithm of other steps)
all price here; no other module turns a link's latency and bandwidth into seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .algorithms import DEFAULT, entry, variants
from .traffic import known

__all__ = ["Link", "fastest", "known", "latency_scale", "moved", "seconds", "spread_seconds", "steps"]


@dataclass(frozen=True)
class Link:
    """What a collective's traffic crosses: achieved bandwidth per rank (bytes/s) and latency per message step (s)."""

    name: str
    bandwidth: float
    latency: float

    @classmethod
    def of(cls, name: str, bandwidth_gb_s: float, latency_us: float, efficiency: float = 1.0, rails: int = 1) -> Link:
        """A spec-sheet link (GB/s per rail, us) at the fraction `efficiency` of its peak that collectives reach,
        over `rails` rails driven at once."""
        return cls(name, rails * bandwidth_gb_s * 1e9 * efficiency, latency_us * 1e-6)


def moved(kind: str, p: int, algorithm: str = DEFAULT) -> float:
    """Fraction of the tensor one rank moves in collective `kind` over p ranks on `algorithm` (its registration's)."""
    return entry(algorithm).traffic(kind, p)


def steps(kind: str, p: int, algorithm: str = DEFAULT) -> int:
    """Message steps one rank takes in collective `kind` over p ranks on `algorithm` (its registration's)."""
    return entry(algorithm).steps(kind, p)


def seconds(kind: str, nbytes: float, p: int, link: Link, algorithm: str = DEFAULT, calls: float = 1) -> float:
    """Seconds of `calls` collectives `kind` over p ranks on `link` on `algorithm`, moving `nbytes` of tensor in all
    (each call pays the steps' latency; the bytes are the whole tensors, not what a rank moves)."""
    registered = entry(algorithm)
    return calls * (registered.steps(kind, p) * link.latency) + registered.traffic(kind, p) * nbytes / link.bandwidth


def fastest(kind: str, nbytes: float, p: int, link: Link, algorithm: str = DEFAULT) -> tuple[float, str]:
    """Seconds of one call of `algorithm` and the algorithm it runs: its own, or one registered inside it that
    implements `kind` and is faster for this message (a tie keeps its own)."""
    best, name = seconds(kind, nbytes, p, link, algorithm), algorithm
    for alt in variants(algorithm):
        if alt.implements(kind) and (t := seconds(kind, nbytes, p, link, alt.name)) < best:
            best, name = t, alt.name
    return best, name


def spread_seconds(kind: str, nbytes: float, p: int, near: Link | None, local: int, far: Link | None,
                   algorithm: str = DEFAULT) -> float:
    """Seconds of a collective whose p - 1 peers are split between two links driven at once (an all-to-all's
    pairwise exchanges): `local` - 1 of them over `near`, the others over `far`. Each link carries its peers' share
    of what a rank moves; the slower share sets the time, plus the steps at the far link's latency (the near one's
    when every peer is near)."""
    sent = moved(kind, p, algorithm) * nbytes
    near_s = sent * (local - 1) / (p - 1) / near.bandwidth if local > 1 and near is not None else 0.0
    far_s = sent * (p - local) / (p - 1) / far.bandwidth if local < p and far is not None else 0.0
    link = far if local < p else near
    latency = link.latency if link is not None else 0.0
    return steps(kind, p, algorithm) * latency + max(near_s, far_s)


def latency_scale(kind: str, p: int, algorithm: str, line: str) -> float:
    """What a per-call latency fitted on `line`'s calls becomes on `algorithm`'s: the ratio of their message steps
    (1 where they take the same, or where `line` takes none)."""
    mine, theirs = steps(kind, p, algorithm), steps(kind, p, line)
    return mine / theirs if theirs else 1.0
