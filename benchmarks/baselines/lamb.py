"""LAMB (You et al. 2020, Algorithm 2) in two phases, fp32, with per-tensor trust ratios.

Phase 1 (`lamb_norms`) updates m and v and returns each tensor's (||w||^2, ||u||^2), where
u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w: per-block partial sums, added up in a fixed order
(deterministic, fp32). Phase 2 (`lamb_apply`) recomputes u from the stored m, v, w with the same code
and applies w -= lr * ratio * u, ratio = ||w|| / ||u|| (1 where either is 0). Recomputing u instead of
storing it moves the same 40 bytes per parameter (read w, g, m, v, write m, v; read w, m, v, write w) and
needs no buffer. Between the phases a sliced optimizer all-reduces the squared norms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from cocoweave.kernels.multi_tensor import check_flat, table_block, table_pointer, tensor_table

BLOCK = 4096
NUM_WARPS = 8
REDUCE_BLOCK = 1024


@triton.jit
def _direction(w, m, v, inv_bc1, inv_bc2, eps, weight_decay):
    """The update direction u; both phases call this so that they compute the same u."""
    return tl.div_rn(m * inv_bc1, tl.sqrt_rn(v * inv_bc2) + eps) + weight_decay * w


@triton.jit
def _norms_update(w_ptr, g_ptr, m_ptr, v_ptr, partial_ptr, offs, mask, other,
                  beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay):
    w = tl.load(w_ptr + offs, mask=mask, other=other)
    g = tl.load(g_ptr + offs, mask=mask, other=other)
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=other) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=other) + (1.0 - beta2) * g * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    u = _direction(w, m, v, inv_bc1, inv_bc2, eps, weight_decay)
    if mask is not None:  # masked lanes hold m = v = w = 0: u is 0 / (0 + eps), NaN when eps = 0
        u = tl.where(mask, u, 0.0)
    tl.store(partial_ptr, tl.sum(w * w, axis=0))
    tl.store(partial_ptr + 1, tl.sum(u * u, axis=0))


@triton.jit
def _norms_block(w_ptr, g_ptr, m_ptr, v_ptr, partial_ptr, left,
                 beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if left >= BLOCK:  # only a tensor's last block is masked
        _norms_update(w_ptr, g_ptr, m_ptr, v_ptr, partial_ptr, offs, None, None,
                      beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay)
    else:
        _norms_update(w_ptr, g_ptr, m_ptr, v_ptr, partial_ptr, offs, offs < left, 0.0,
                      beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay)


@triton.jit
def _apply_update(w_ptr, m_ptr, v_ptr, norms_ptr, offs, mask, lr, eps, inv_bc1, inv_bc2, weight_decay):
    w_sq = tl.load(norms_ptr)
    u_sq = tl.load(norms_ptr + 1)
    ratio = tl.where((w_sq > 0) & (u_sq > 0), tl.sqrt_rn(w_sq) / tl.sqrt_rn(u_sq), 1.0)
    w = tl.load(w_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    u = _direction(w, m, v, inv_bc1, inv_bc2, eps, weight_decay)
    tl.store(w_ptr + offs, w - (lr * ratio) * u, mask=mask)


@triton.jit
def _apply_block(w_ptr, m_ptr, v_ptr, norms_ptr, left, lr, eps, inv_bc1, inv_bc2, weight_decay,
                 BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if left >= BLOCK:
        _apply_update(w_ptr, m_ptr, v_ptr, norms_ptr, offs, None, lr, eps, inv_bc1, inv_bc2, weight_decay)
    else:
        _apply_update(w_ptr, m_ptr, v_ptr, norms_ptr, offs, offs < left,
                      lr, eps, inv_bc1, inv_bc2, weight_decay)


@triton.jit
def _norms_kernel(w_ptr, g_ptr, m_ptr, v_ptr, partial_ptr, n,
                  beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    _norms_block(w_ptr + start, g_ptr + start, m_ptr + start, v_ptr + start, partial_ptr + 2 * pid,
                 n - start, beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay, BLOCK)


@triton.jit
def _apply_kernel(w_ptr, m_ptr, v_ptr, norms_ptr, n, lr, eps, inv_bc1, inv_bc2, weight_decay,
                  BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    _apply_block(w_ptr + start, m_ptr + start, v_ptr + start, norms_ptr, n - start,
                 lr, eps, inv_bc1, inv_bc2, weight_decay, BLOCK)


@triton.jit
def _norms_multi_kernel(addresses_ptr, numels_ptr, block_tensor_ptr, block_index_ptr, partial_ptr,
                        beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay,
                        BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    t, start, left = table_block(block_tensor_ptr, block_index_ptr, numels_ptr, BLOCK)
    _norms_block(table_pointer(addresses_ptr, t, 0, 4, start, ALIGNED),
                 table_pointer(addresses_ptr, t, 1, 4, start, ALIGNED),
                 table_pointer(addresses_ptr, t, 2, 4, start, ALIGNED),
                 table_pointer(addresses_ptr, t, 3, 4, start, ALIGNED),
                 partial_ptr + 2 * tl.program_id(0), left,
                 beta1, beta2, eps, inv_bc1, inv_bc2, weight_decay, BLOCK)


@triton.jit
def _reduce_kernel(partial_ptr, first_block_ptr, norms_ptr, BLOCK: tl.constexpr):
    """norms[t] = sum of the partial (||w||^2, ||u||^2) of tensor t's blocks, in a fixed order."""
    t = tl.program_id(0)
    lo = tl.load(first_block_ptr + t)
    hi = tl.load(first_block_ptr + t + 1)
    rows = tl.arange(0, BLOCK)[:, None]
    cols = tl.arange(0, 2)[None, :]
    acc = tl.zeros((BLOCK, 2), dtype=tl.float32)
    for i in range(lo, hi, BLOCK):
        acc += tl.load(partial_ptr + (i + rows) * 2 + cols, mask=i + rows < hi, other=0.0)
    tl.store(norms_ptr + 2 * t + tl.arange(0, 2), tl.sum(acc, axis=0))


@triton.jit
def _apply_multi_kernel(addresses_ptr, numels_ptr, block_tensor_ptr, block_index_ptr, norms_ptr,
                        lr, eps, inv_bc1, inv_bc2, weight_decay, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    t, start, left = table_block(block_tensor_ptr, block_index_ptr, numels_ptr, BLOCK)
    _apply_block(table_pointer(addresses_ptr, t, 0, 3, start, ALIGNED),
                 table_pointer(addresses_ptr, t, 1, 3, start, ALIGNED),
                 table_pointer(addresses_ptr, t, 2, 3, start, ALIGNED),
                 norms_ptr + 2 * t, left, lr, eps, inv_bc1, inv_bc2, weight_decay, BLOCK)


def _bias_corrections(beta1: float, beta2: float, step: int, bias_correction: bool) -> tuple[float, float]:
    """(1 / (1 - beta1^step), 1 / (1 - beta2^step)), or (1, 1) without bias correction."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 / (1.0 - beta1**step), 1.0 / (1.0 - beta2**step)


def lamb_norms(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
    beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6, weight_decay: float = 0.0,
    bias_correction: bool = True, block: int = BLOCK, num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """LAMB phase 1 on one flat fp32 tensor: update m, v in place; return [||w||^2, ||u||^2] (fp32)."""
    n = check_flat(param, grad, exp_avg, exp_avg_sq)
    grid = (triton.cdiv(n, block),)
    partials = torch.empty(grid[0], 2, dtype=torch.float32, device=param.device)
    if n:
        _norms_kernel[grid](param, grad, exp_avg, exp_avg_sq, partials, n, beta1, beta2, eps,
                            *_bias_corrections(beta1, beta2, step, bias_correction), weight_decay,
                            BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)
    return partials.sum(dim=0)


def lamb_apply(
    param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, norms_sq: torch.Tensor, *,
    lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
    weight_decay: float = 0.0, bias_correction: bool = True, block: int = BLOCK, num_warps: int = NUM_WARPS,
) -> None:
    """LAMB phase 2 on one flat fp32 tensor: w -= lr * trust_ratio * u, from phase 1's (summed) norms."""
    n = check_flat(param, exp_avg, exp_avg_sq)
    if n:
        _apply_kernel[(triton.cdiv(n, block),)](param, exp_avg, exp_avg_sq, norms_sq, n, lr, eps,
                                                *_bias_corrections(beta1, beta2, step, bias_correction),
                                                weight_decay, BLOCK=block, num_warps=num_warps,
                                                enable_fp_fusion=False)


def lamb_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-6,
    weight_decay: float = 0.0, bias_correction: bool = True, block: int = BLOCK, num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """One in-place LAMB step on one flat fp32 tensor (both phases); returns [||w||^2, ||u||^2]."""
    opts = dict(step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                bias_correction=bias_correction, block=block, num_warps=num_warps)
    norms_sq = lamb_norms(param, grad, exp_avg, exp_avg_sq, **opts)
    lamb_apply(param, exp_avg, exp_avg_sq, norms_sq, lr=lr, **opts)
    return norms_sq


def lamb_norms_multi(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor], *, step: int, beta1: float = 0.9, beta2: float = 0.999,
    eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True, block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """`lamb_norms` on lists of tensors in one launch (plus a small reduction); returns [n_tensors, 2]."""
    table = tensor_table([params, grads, exp_avgs, exp_avg_sqs], block)
    partials = torch.empty(table.num_blocks, 2, dtype=torch.float32, device=params[0].device)
    norms_sq = torch.empty(len(params), 2, dtype=torch.float32, device=params[0].device)
    if table.num_blocks:
        _norms_multi_kernel[(table.num_blocks,)](
            table.addresses, table.numels, table.block_tensor, table.block_index, partials, beta1, beta2, eps,
            *_bias_corrections(beta1, beta2, step, bias_correction), weight_decay,
            BLOCK=block, ALIGNED=table.aligned, num_warps=num_warps, enable_fp_fusion=False)
    _reduce_kernel[(len(params),)](partials, table.first_block, norms_sq, BLOCK=REDUCE_BLOCK,
                                   enable_fp_fusion=False)
    return norms_sq


def lamb_apply_multi(
    params: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
    norms_sq: torch.Tensor, *, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999,
    eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True, block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """`lamb_apply` on lists of tensors in one launch, tensor t scaled by its own trust ratio."""
    table = tensor_table([params, exp_avgs, exp_avg_sqs], block)
    if table.num_blocks:
        _apply_multi_kernel[(table.num_blocks,)](
            table.addresses, table.numels, table.block_tensor, table.block_index, norms_sq, lr, eps,
            *_bias_corrections(beta1, beta2, step, bias_correction), weight_decay,
            BLOCK=block, ALIGNED=table.aligned, num_warps=num_warps, enable_fp_fusion=False)


def lamb_step_multi(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor], *, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999,
    eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True, block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """One in-place LAMB step on lists of tensors (per-tensor trust ratios); returns [n_tensors, 2] norms."""
    opts = dict(step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                bias_correction=bias_correction, block=block, num_warps=num_warps)
    norms_sq = lamb_norms_multi(params, grads, exp_avgs, exp_avg_sqs, **opts)
    lamb_apply_multi(params, exp_avgs, exp_avg_sqs, norms_sq, lr=lr, **opts)
    return norms_sq
