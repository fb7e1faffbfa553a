"""SGD steps with momentum, dampening, Nesterov and weight decay (torch.optim.SGD semantics, fp32).

With momentum: one read of p, g, buf and one write of p, buf (20 bytes per parameter); on the first step
the buffer is only written (torch sets it to the gradient); without momentum there is no buffer at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from cocoweave.kernels.multi_tensor import check_flat, table_block, table_pointer, tensor_table

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _sgd_update(p_ptr, g_ptr, buf_ptr, offs, mask, lr, momentum, keep, weight_decay,
                WEIGHT_DECAY: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                FIRST: tl.constexpr):
    p = tl.load(p_ptr + offs, mask=mask)
    d = tl.load(g_ptr + offs, mask=mask)
    if WEIGHT_DECAY:
        d = d + weight_decay * p
    if MOMENTUM:
        if FIRST:
            buf = d
        else:  # keep = 1 - dampening
            buf = momentum * tl.load(buf_ptr + offs, mask=mask) + keep * d
        tl.store(buf_ptr + offs, buf, mask=mask)
        if NESTEROV:
            d = d + momentum * buf
        else:
            d = buf
    tl.store(p_ptr + offs, p - lr * d, mask=mask)


@triton.jit
def _sgd_block(p_ptr, g_ptr, buf_ptr, left, lr, momentum, keep, weight_decay, WEIGHT_DECAY: tl.constexpr,
               MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """Update BLOCK elements from the given pointers; only a tensor's last block is masked."""
    offs = tl.arange(0, BLOCK)
    if left >= BLOCK:
        _sgd_update(p_ptr, g_ptr, buf_ptr, offs, None, lr, momentum, keep, weight_decay,
                    WEIGHT_DECAY, MOMENTUM, NESTEROV, FIRST)
    else:
        _sgd_update(p_ptr, g_ptr, buf_ptr, offs, offs < left, lr, momentum, keep, weight_decay,
                    WEIGHT_DECAY, MOMENTUM, NESTEROV, FIRST)


@triton.jit
def _sgd_kernel(p_ptr, g_ptr, buf_ptr, n, lr, momentum, keep, weight_decay, WEIGHT_DECAY: tl.constexpr,
                MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    _sgd_block(p_ptr + start, g_ptr + start, buf_ptr + start, n - start, lr, momentum, keep, weight_decay,
               WEIGHT_DECAY, MOMENTUM, NESTEROV, FIRST, BLOCK)


@triton.jit
def _sgd_multi_kernel(addresses_ptr, numels_ptr, block_tensor_ptr, block_index_ptr,
                      lr, momentum, keep, weight_decay, WEIGHT_DECAY: tl.constexpr,
                      MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr,
                      BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    t, start, left = table_block(block_tensor_ptr, block_index_ptr, numels_ptr, BLOCK)
    N_LISTS: tl.constexpr = 3 if MOMENTUM else 2
    p_ptr = table_pointer(addresses_ptr, t, 0, N_LISTS, start, ALIGNED)
    g_ptr = table_pointer(addresses_ptr, t, 1, N_LISTS, start, ALIGNED)
    buf_ptr = table_pointer(addresses_ptr, t, N_LISTS - 1, N_LISTS, start, ALIGNED)  # unused if no momentum
    _sgd_block(p_ptr, g_ptr, buf_ptr, left, lr, momentum, keep, weight_decay,
               WEIGHT_DECAY, MOMENTUM, NESTEROV, FIRST, BLOCK)


def _flags(momentum: float, dampening: float, nesterov: bool, weight_decay: float, first_step: bool,
           has_buffer: bool) -> dict[str, bool]:
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if has_buffer != (momentum != 0):
        raise ValueError("pass momentum buffers exactly when momentum is non-zero")
    return dict(WEIGHT_DECAY=weight_decay != 0, MOMENTUM=momentum != 0, NESTEROV=nesterov, FIRST=first_step)


def sgd_step(
    param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, *, lr: float,
    momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
    first_step: bool = False, block: int = BLOCK, num_warps: int = NUM_WARPS,
) -> None:
    """One in-place SGD step on contiguous fp32 tensors; `first_step` initialises the momentum buffer."""
    flags = _flags(momentum, dampening, nesterov, weight_decay, first_step, momentum_buffer is not None)
    n = check_flat(param, grad, *([] if momentum_buffer is None else [momentum_buffer]))
    buf = param if momentum_buffer is None else momentum_buffer  # never touched without momentum
    if n:
        _sgd_kernel[(triton.cdiv(n, block),)](param, grad, buf, n, lr, momentum, 1.0 - dampening,
                                              weight_decay, **flags, BLOCK=block, num_warps=num_warps,
                                              enable_fp_fusion=False)


def sgd_step_multi(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor] | None, *, lr: float, momentum: float = 0.0,
    dampening: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0, first_step: bool = False,
    block: int = BLOCK, num_warps: int = NUM_WARPS,
) -> None:
    """`sgd_step` on lists of tensors in one launch."""
    flags = _flags(momentum, dampening, nesterov, weight_decay, first_step, momentum_buffers is not None)
    table = tensor_table([params, grads] + ([] if momentum_buffers is None else [momentum_buffers]), block)
    if table.num_blocks:
        _sgd_multi_kernel[(table.num_blocks,)](table.addresses, table.numels, table.block_tensor,
                                               table.block_index, lr, momentum, 1.0 - dampening, weight_decay,
                                               **flags, BLOCK=block, ALIGNED=table.aligned,
                                               num_warps=num_warps, enable_fp_fusion=False)
