"""Initialisation of one rank's part of a sharded weight with the values the whole weight would have.

A logical (rows, cols) tensor is drawn tile by tile: tile (a, b), rows [a*TILE, (a+1)*TILE) x cols [b*TILE, ...), is
uniform(-bound, bound) from its own torch.Generator seeded by (seed, stream, a, b). Any block of the tensor (a rank's
rows, a rank's columns, the whole of it) therefore has the same values, and a rank draws only the tiles its block
touches (plus at most one tile of margin per side), never the whole weight.

    part = torch.empty(stop - start, in_features)
    partitioned_uniform_(part, (out_features, in_features), (start, 0), bound, seed)   # rows [start, stop)
"""

from __future__ import annotations

import torch

from .functional import mix_seed

TILE = 256


def partitioned_uniform_(out: torch.Tensor, full_shape: tuple[int, ...], start: tuple[int, ...], bound: float,
                         seed: int, stream: int = 0) -> torch.Tensor:
    """Fill `out` (1-D or 2-D, any device and dtype) with its block, at `start`, of the logical tensor of
    `full_shape` drawn tile by tile (see the module); returns `out`."""
    if out.is_meta or not out.numel():
        return out
    if out.dim() == 1:
        partitioned_uniform_(out.view(-1, 1), (full_shape[0], 1), (start[0], 0), bound, seed, stream)
        return out
    (R, C), (r0, c0), (rows, cols) = full_shape, start, out.shape
    with torch.no_grad():
        for a in range(r0 // TILE, -(-(r0 + rows) // TILE)):
            a0, a1 = a * TILE, min(R, (a + 1) * TILE)
            lo, hi = max(a0, r0), min(a1, r0 + rows)
            band = torch.empty(hi - lo, cols)
            for b in range(c0 // TILE, -(-(c0 + cols) // TILE)):
                b0, b1 = b * TILE, min(C, (b + 1) * TILE)
                gen = torch.Generator().manual_seed(mix_seed(seed, stream, a, b))
                tile = torch.empty(a1 - a0, b1 - b0).uniform_(-bound, bound, generator=gen)
                c_lo, c_hi = max(b0, c0), min(b1, c0 + cols)
                band[:, c_lo - c0:c_hi - c0] = tile[lo - a0:hi - a0, c_lo - b0:c_hi - b0]
            out[lo - r0:hi - r0].copy_(band)
    return out
