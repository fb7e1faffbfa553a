"""The Adasum maths both backends share (Maleki et al., MLSys 2021): the pairwise combination, its
coefficients, and the order in which a group's ranks are combined. The reference backend applies them to
whole tensors; the torch backend's vector-halving distance-doubling (torch/adasum.py) to pieces, in the
same order, so both give the same result."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A squared norm below this keeps its adasum coefficient at 1 (no division by ~0). It is
# sqrt(float64's smallest normal) = 2**-511, Horovod's value: float64 accumulation keeps every nonzero
# fp32/fp16/bf16 tensor above it (fp32's smallest subnormal squared is ~2e-90) and dot/|a|^2 finite.
ADASUM_EPS = 2.0 ** -511


def adasum_coefficients(triple: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Adasum's scalars (ca, cb) from the float64 tensor [a·b, |a|^2, |b|^2]: a coefficient is
    1 - a·b / (2|x|^2), or 1 where |x|^2 < ADASUM_EPS. Computed where `triple` is (on a GPU: no host sync)."""
    dot, na, nb = triple.unbind()
    ca = torch.where(na >= ADASUM_EPS, 1.0 - dot / (2.0 * na), 1.0)
    cb = torch.where(nb >= ADASUM_EPS, 1.0 - dot / (2.0 * nb), 1.0)
    return ca, cb


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors: (1 - a·b / 2|a|^2) a + (1 - a·b / 2|b|^2) b, with per-tensor coefficients
    from a dot product and norms accumulated in float64; the sum is formed in float64, rounded once."""
    a64, b64 = a.double(), b.double()
    ca, cb = adasum_coefficients(torch.stack([torch.sum(x * y) for x, y in ((a64, b64), (a64, a64), (b64, b64))]))
    return (ca * a64 + cb * b64).to(a.dtype)


def adasum_survivors(n: int) -> list[list[int]]:
    """Adasum's pairing for n ranks, n = 2^k + e with 0 <= e < 2^k: the first e odd ranks fold into
    their even left neighbour (rank 2i+1 into rank 2i, i < e); the 2^k groups that remain, in rank
    order, are combined by a balanced binary tree. Returns those 2^k groups of ranks."""
    k = n.bit_length() - 1
    e = n - (1 << k)
    return [[2 * i, 2 * i + 1] for i in range(e)] + [[r] for r in range(2 * e, n)]


def adasum_tree(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum over a group's ranks in the order of `adasum_survivors`: fold pairs (r0 + r1) ... until
    a power of two remains, then ((s0 + s1) + (s2 + s3)) ...; exactly the torch backend's order."""
    level = [parts[g[0]] if len(g) == 1 else adasum_pair(parts[g[0]], parts[g[1]])
             for g in adasum_survivors(len(parts))]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]
