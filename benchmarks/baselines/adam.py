"""Adam / AdamW steps (torch.optim.Adam(W) semantics, fp32): one read of p, g, m, v and one write of p, m, v.

That is 28 bytes per parameter, the least any Adam step can move. `adam_step` updates one flat tensor (or a
flat slice of one); `adam_step_multi` updates a list of tensors in one launch through a tensor table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from cocoweave.kernels.multi_tensor import check_flat, table_block, table_pointer, tensor_table

BLOCK = 4096
NUM_WARPS = 8
# weight-decay modes; kernels can read module globals only when they are tl.constexpr
NO_DECAY, L2_DECAY, DECOUPLED_DECAY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, step_size, beta1, beta2, eps, bc2_sqrt, decay,
                 DECAY: tl.constexpr):
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if DECAY == L2_DECAY:  # Adam: decay enters the gradient (decay = weight_decay)
        g = g + decay * p
    if DECAY == DECOUPLED_DECAY:  # AdamW: decay shrinks the weights (decay = lr * weight_decay)
        p = p - decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt_rn(v) / bc2_sqrt + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


@triton.jit
def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, left, step_size, beta1, beta2, eps, bc2_sqrt, decay,
                DECAY: tl.constexpr, BLOCK: tl.constexpr):
    """Update BLOCK elements from the given pointers; only a tensor's last block is masked."""
    offs = tl.arange(0, BLOCK)
    if left >= BLOCK:
        _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, None,
                     step_size, beta1, beta2, eps, bc2_sqrt, decay, DECAY)
    else:
        _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < left,
                     step_size, beta1, beta2, eps, bc2_sqrt, decay, DECAY)


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, step_size, beta1, beta2, eps, bc2_sqrt, decay,
                 DECAY: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    _adam_block(p_ptr + start, g_ptr + start, m_ptr + start, v_ptr + start, n - start,
                step_size, beta1, beta2, eps, bc2_sqrt, decay, DECAY, BLOCK)


@triton.jit
def _adam_multi_kernel(addresses_ptr, numels_ptr, block_tensor_ptr, block_index_ptr,
                       step_size, beta1, beta2, eps, bc2_sqrt, decay,
                       DECAY: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    t, start, left = table_block(block_tensor_ptr, block_index_ptr, numels_ptr, BLOCK)
    _adam_block(table_pointer(addresses_ptr, t, 0, 4, start, ALIGNED),
                table_pointer(addresses_ptr, t, 1, 4, start, ALIGNED),
                table_pointer(addresses_ptr, t, 2, 4, start, ALIGNED),
                table_pointer(addresses_ptr, t, 3, 4, start, ALIGNED),
                left, step_size, beta1, beta2, eps, bc2_sqrt, decay, DECAY, BLOCK)


def _scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
             step: int) -> tuple[tuple[float, ...], int]:
    """Kernel scalars (bias corrections on the host, in double) and the decay mode."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    mode = (NO_DECAY if weight_decay == 0 else DECOUPLED_DECAY if decoupled else L2_DECAY).value
    decay = lr * weight_decay if decoupled else weight_decay
    step_size = lr / (1 - beta1**step)
    return (step_size, beta1, beta2, eps, (1 - beta2**step) ** 0.5, decay), mode


def adam_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
    weight_decay: float = 0.0, decoupled: bool = False, block: int = BLOCK, num_warps: int = NUM_WARPS,
) -> None:
    """One in-place Adam step (AdamW if `decoupled`) on contiguous fp32 tensors; `step` counts from 1."""
    n = check_flat(param, grad, exp_avg, exp_avg_sq)
    scalars, mode = _scalars(lr, beta1, beta2, eps, weight_decay, decoupled, step)
    if n:
        _adam_kernel[(triton.cdiv(n, block),)](param, grad, exp_avg, exp_avg_sq, n, *scalars,
                                               DECAY=mode, BLOCK=block, num_warps=num_warps,
                                               enable_fp_fusion=False)


def adam_step_multi(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor], *, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999,
    eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = False, block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """`adam_step` on lists of tensors (tensor i of each list alike in size), in one launch."""
    table = tensor_table([params, grads, exp_avgs, exp_avg_sqs], block)
    scalars, mode = _scalars(lr, beta1, beta2, eps, weight_decay, decoupled, step)
    if table.num_blocks:
        _adam_multi_kernel[(table.num_blocks,)](table.addresses, table.numels, table.block_tensor,
                                                table.block_index, *scalars, DECAY=mode, BLOCK=block,
                                                ALIGNED=table.aligned, num_warps=num_warps,
                                                enable_fp_fusion=False)
