"""The counter-based random numbers behind `dropout`: one hash, identical in torch ops and in Triton.

A dropout mask element depends only on (seed, index of the element in the *logical* tensor)
and, for Local tensors, the rank. So every schedule (sliced or not, chunked or not) and every
backend draws the same mask. The hash is `triple32` (Chris Wellons' hash-prospector): three
multiply / xor-shift rounds on uint32, a full-avalanche bijection of 2^32.

    key  = triple32(seed ^ 0x9E3779B9) ^ triple32(rank + 0x632BE5AB)     (host side, once)
    bits = triple32(index ^ key)                                          (per element)
    keep = bits >= threshold(p),  threshold(p) = min(floor(p * 2^32), 2^32 - 1)

`index` is the element's row-major position in the logical tensor modulo 2^32. Kept elements
are scaled by 1 / (1 - p). The Triton twin lives in `cocoweave.kernels.rng`; tests assert that
both give bit-identical masks.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
M1, M2, M3 = 0xED5AD4BB, 0xAC4C1B51, 0x31848BAB
SEED_SALT = 0x9E3779B9
RANK_SALT = 0x632BE5AB
NO_RANK = 0  # Replicated and Sliced tensors use rank term triple32(0 + RANK_SALT)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def triple32(x: torch.Tensor) -> torch.Tensor:
    """The triple32 hash of uint32 values stored in an int64 tensor."""
    x = x & MASK32
    x = x ^ (x >> 17)
    x = _mul32(x, M1)
    x = x ^ (x >> 11)
    x = _mul32(x, M2)
    x = x ^ (x >> 15)
    x = _mul32(x, M3)
    x = x ^ (x >> 14)
    return x


def triple32_int(x: int) -> int:
    """triple32 of a Python int (host side)."""
    x &= MASK32
    x ^= x >> 17
    x = (x * M1) & MASK32
    x ^= x >> 11
    x = (x * M2) & MASK32
    x ^= x >> 15
    x = (x * M3) & MASK32
    x ^= x >> 14
    return x


def dropout_key(seed: int, rank: int = NO_RANK) -> int:
    """The per-(seed, rank) key mixed into every element's index."""
    return triple32_int((seed & MASK32) ^ SEED_SALT) ^ triple32_int((rank + RANK_SALT) & MASK32)


def keep_threshold(p: float) -> int:
    """Elements whose hash is >= this uint32 threshold are kept."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(int(p * 2**32), MASK32)


def _bits(index: torch.Tensor, key: int) -> torch.Tensor:
    """uint32 hash values (as int64) of logical element indices `index` under `key`."""
    return triple32((index.to(torch.int64) & MASK32) ^ key)


def random_bits(index: torch.Tensor, seed: int, rank: int = NO_RANK) -> torch.Tensor:
    """uint32 hash values (as int64) for logical element indices `index`."""
    return _bits(index, dropout_key(seed, rank))


def keep_mask(index: torch.Tensor, key: int, threshold: int) -> torch.Tensor:
    """Boolean keep-mask for logical element indices `index`, under a key (`dropout_key(seed, rank)`) and a threshold
    (`keep_threshold(p)`) computed once on the host: the one signature of the torch runtime's and the Triton
    kernels' (kernels/rng.py) keep-masks."""
    return _bits(index, key) >= threshold


def logical_index(shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """Row-major element indices of a logical tensor of `shape` (slice it like the data)."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int64, device=device).reshape(shape)


def dropout(x: torch.Tensor, index: torch.Tensor, p: float, seed: int, rank: int = NO_RANK) -> torch.Tensor:
    """Dropout of `x` whose elements sit at logical positions `index` (same shape as x)."""
    if p == 0.0:
        return x
    keep = keep_mask(index, dropout_key(seed, rank), keep_threshold(p))
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))
