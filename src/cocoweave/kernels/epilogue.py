"""The fused epilogue `out = dropout(x + bias, p, seed) + residual` (bf16, fp16, fp32; fp32 arithmetic).

The dropout mask is that of `cocoweave.rng`: it depends on each element's index in the *logical* tensor,
so a slice of it along one dim draws the same mask as the full tensor would there. The kernel sees x as
rows of the bias length L; row r of the slice starts at logical index
    (r // G) * group_stride + col_offset + (r % G) * L        (all mod 2^32)
where G is the number of local rows per slice group (one group per index of the dims before the sliced
one). Tiles are [BLOCK_R, BLOCK_C]: the row arithmetic costs BLOCK_R operations per tile, the per-element
cost is one hash, one compare and the fused arithmetic. One read of x and residual, one write of out.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cocoweave import rng
from cocoweave.kernels.multi_tensor import check_device
from cocoweave.kernels.rng import keep_mask

BLOCK = 4096
NUM_WARPS = 4
MAX_BLOCK_C = 1024


@triton.jit(do_not_specialize=["group_stride", "col_offset", "key", "threshold"])
def _bias_dropout_residual_kernel(x_ptr, bias_ptr, res_ptr, out_ptr, R, L, G, group_stride, col_offset,
                                  key, threshold, scale, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    col_blocks = tl.cdiv(L, BLOCK_C)
    pid = tl.program_id(0)
    rows = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < L)[None, :]
    offs = rows.to(tl.int64)[:, None] * L + cols[None, :]

    y = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < L).to(tl.float32)[None, :]
    if DROPOUT:
        # logical index of each row's first element, in uint32 arithmetic (wraps mod 2^32 like the spec)
        group = rows // G
        row_start = (group.to(tl.uint32) * group_stride.to(tl.uint32) + col_offset.to(tl.uint32)
                     + (rows - group * G).to(tl.uint32) * L)
        index = row_start[:, None] + cols.to(tl.uint32)[None, :]
        y = tl.where(keep_mask(index, key, threshold), y * scale, 0.0)
    y += tl.load(res_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def bias_dropout_residual(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, seed: int, *,
    rank: int = rng.NO_RANK, dim: int = 0, offset: int = 0, full_size: int | None = None,
    out: torch.Tensor | None = None, block: int = BLOCK, num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """dropout(x + bias, p, seed) + residual, for a contiguous x that is the slice
    [offset, offset + x.shape[dim]) along `dim` of a logical tensor of size `full_size` there (default: all).

    `bias` (or None) has x's last-dim size, already sliced if `dim` is the last dim; `rank` is only for
    Local tensors. Arithmetic is fp32; the result has the dtype torch's `dropout(x + bias) + residual` promotes
    to (written into `out` if given). Every tensor must be on x's device: CUDA (CPU under TRITON_INTERPRET=1).
    """
    check_device("bias_dropout_residual", *(t for t in (x, bias, residual, out) if t is not None))
    if x.dim() == 0 or not x.is_contiguous() or residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"expected contiguous x and residual of one shape, got {tuple(x.shape)}, "
                         f"{tuple(residual.shape)}")
    L = x.shape[-1]
    if bias is not None and (bias.shape != (L,) or not bias.is_contiguous()):
        raise ValueError(f"expected a contiguous bias of shape ({L},), got {tuple(bias.shape)}")
    dim %= x.dim()
    full_size = x.shape[dim] if full_size is None else full_size
    if offset < 0 or offset + x.shape[dim] > full_size:
        raise ValueError(f"slice [{offset}, {offset + x.shape[dim]}) of dim {dim} exceeds its size "
                         f"{full_size}")
    dtype = torch.promote_types(x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype), residual.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of x's shape (torch's promotion of x, bias and "
                         f"residual), got {out.dtype} {tuple(out.shape)}")
    if x.numel() == 0:
        return out
    after = math.prod(x.shape[dim + 1:])  # logical elements per index of `dim`
    R = x.numel() // L
    G = x.shape[dim] * after // L  # local rows per group (L divides `after`, or dim is the last dim)
    block_c = min(triton.next_power_of_2(L), MAX_BLOCK_C)
    block_r = max(1, block // block_c)
    grid = (triton.cdiv(R, block_r) * triton.cdiv(L, block_c),)
    _bias_dropout_residual_kernel[grid](
        x, x if bias is None else bias, residual, out, R, L, G, (full_size * after) % 2**32,
        (offset * after) % 2**32, rng.dropout_key(seed, rank), rng.keep_threshold(p), 1.0 / (1.0 - p),
        HAS_BIAS=bias is not None, DROPOUT=p > 0, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps,
        enable_fp_fusion=False)
    return out
