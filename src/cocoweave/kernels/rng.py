"""The Triton twin of `cocoweave.rng`: the triple32 hash and the dropout keep-mask, bit-identical to torch's.

Key and threshold are computed once on the host (`cocoweave.rng.dropout_key`, `keep_threshold`) and passed
to the kernels as integers; each element then costs one hash of its logical index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cocoweave import rng


@triton.jit
def triple32(x):
    """triple32 of a tl.uint32 tensor: three multiply / xor-shift rounds (the constants are uint32)."""
    x = x ^ (x >> 17)
    x = x * 0xED5AD4BB
    x = x ^ (x >> 11)
    x = x * 0xAC4C1B51
    x = x ^ (x >> 15)
    x = x * 0x31848BAB
    x = x ^ (x >> 14)
    return x


@triton.jit
def keep_mask(index, key, threshold):
    """Keep-mask of logical indices (tl.uint32, i.e. mod 2^32) for a host-computed key and threshold: the signature
    of `cocoweave.rng.keep_mask`, which the torch runtime calls."""
    return triple32(index ^ key.to(tl.uint32)) >= threshold.to(tl.uint32)


@triton.jit(do_not_specialize=["key"])
def _random_bits_kernel(index_ptr, out_ptr, n, key, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    index = tl.load(index_ptr + offs, mask=mask).to(tl.uint32)  # int64 -> uint32 keeps the low 32 bits
    bits = triple32(index ^ key.to(tl.uint32))
    tl.store(out_ptr + offs, bits.to(tl.int64), mask=mask)  # zero-extends: values in [0, 2^32)


def random_bits(index: torch.Tensor, seed: int, rank: int = rng.NO_RANK, block: int = 4096) -> torch.Tensor:
    """uint32 hashes (as int64) of logical indices `index`, as `cocoweave.rng.random_bits` computes them."""
    index = index.to(torch.int64).contiguous()
    out = torch.empty_like(index)
    n = index.numel()
    if n:
        _random_bits_kernel[(triton.cdiv(n, block),)](index, out, n, rng.dropout_key(seed, rank), BLOCK=block)
    return out
