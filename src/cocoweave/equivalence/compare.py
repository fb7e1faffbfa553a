"""Helpers to compare results across schedules and backends: tolerances by dtype, error metrics,
and logical views of per-rank inputs and results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backends.inputs import RankInputs, gather_logical
from ..backends.results import RankResult
from ..ir.graph import Program
from ..ir.semantics import HALF

# (atol, rtol) per dtype: float32 allows reassociation; halves allow one rounding per fused chain.
TOLERANCES = {
    torch.float64: (1e-9, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (1e-1, 5e-2),
}


@dataclass(frozen=True)
class Difference:
    """How far `actual` is from `expected`: max absolute and relative error, and whether within tolerance."""

    max_abs: float
    max_rel: float
    ok: bool


def compare(actual: torch.Tensor, expected: torch.Tensor) -> Difference:
    """Compare two tensors with the tolerance of expected's dtype (NaNs must match positions): each element within
    atol + rtol x |expected|, where for 16-bit floats |expected| counts as at least the tensor's root-mean-square."""
    if actual.shape != expected.shape:
        return Difference(float("inf"), float("inf"), False)
    atol, rtol = TOLERANCES.get(expected.dtype, (0.0, 0.0))
    a, e = actual.double(), expected.double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        return Difference(float("nan"), float("nan"), False)
    a, e = a[~nan_e], e[~nan_e]
    if a.numel() == 0:
        return Difference(0.0, 0.0, True)
    same_inf = torch.isinf(e) & (a == e)
    diff = torch.where(same_inf, torch.zeros_like(a), (a - e).abs())
    scale = e.abs()
    rel = diff / scale.clamp_min(1e-12)
    finite = e[torch.isfinite(e)] if expected.dtype in HALF else e[:0]  # the finite elements (16-bit floats only)
    if finite.numel():
        # an element of a sum of rounded 16-bit terms (a matmul's, a reduction's) is off by a rounding of its terms'
        # size, not of its own: where the terms cancel, |expected| is far below them. The tensor's root-mean-square
        # stands in for the terms' size (a fused chain rounded once against the chain rounded op by op: max abs 8.0
        # where |expected| was ~0.2, in outputs of rms ~300, moe_dropless bfloat16 at d 64)
        scale = scale.clamp_min(float(finite.square().mean().sqrt()))  # an infinity is no element's size
    ok = bool((diff <= atol + rtol * scale).all())
    return Difference(diff.max().item(), rel.max().item(), ok)


def compare_results(program: Program, actual: Sequence[RankResult], expected: Sequence[RankResult]) -> Difference:
    """Worst difference over every rank's outputs and updated state."""
    worst = Difference(0.0, 0.0, True)
    for a, e in zip(actual, expected, strict=True):
        for key in ("outputs", "state"):
            ea, aa = getattr(e, key), getattr(a, key)
            if set(ea) != set(aa):
                return Difference(float("inf"), float("inf"), False)
            for name in ea:
                d = compare(aa[name], ea[name])
                worst = Difference(max(worst.max_abs, d.max_abs), max(worst.max_rel, d.max_rel), worst.ok and d.ok)
    return worst


def logical_inputs(program: Program, inputs: Sequence[RankInputs]) -> dict[str, object]:
    """Logical value of every input: the full tensor (Sliced parts concatenated), a stacked
    [ranks, ...] tensor for Local inputs, the number for scalars."""
    world = len(inputs)
    out: dict[str, object] = {}
    for v in program.tensor_inputs:
        ranks = v.group.ranks(world)
        out[v.name] = gather_logical(v, [inputs[r][v.name] for r in ranks])
    for v in program.scalar_inputs:
        out[v.name] = float(inputs[0][v.name])
    return out
