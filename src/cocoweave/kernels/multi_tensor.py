"""Tensor tables: one launch updates a list of tensors in place, with no flattening copy.

A table lives on the device: each tensor's address in every argument list (params, grads, ...), its
element count, and for every program the (tensor, block) pair it owns. A program loads its pair, turns
the int64 addresses into pointers and runs the same block update as the flat kernels. Tables depend only
on (addresses, sizes, block), so they are cached on exactly that key and reused across steps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cocoweave.kernels.precise import interpreted

_CACHE_SIZE = 64


@dataclass(frozen=True)
class TensorTable:
    """Device-side description of `n_lists` parallel lists of `n_tensors` tensors cut into blocks."""

    addresses: torch.Tensor  # int64 [n_tensors, n_lists]: data_ptr of tensor t in list i
    numels: torch.Tensor  # int64 [n_tensors]
    block_tensor: torch.Tensor  # int32 [num_blocks]: which tensor program b updates
    block_index: torch.Tensor  # int32 [num_blocks]: which block of that tensor
    first_block: torch.Tensor  # int64 [n_tensors + 1]: programs of tensor t are first_block[t] .. [t+1] - 1
    num_blocks: int
    aligned: bool  # every address is 16-byte aligned: loads and stores can be 16 bytes wide


_tables: OrderedDict[tuple, TensorTable] = OrderedDict()


def check_device(kernel: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError (one sentence) unless every tensor is on the first one's device, and that is a GPU (or the
    CPU under TRITON_INTERPRET=1): Triton's own error for a CPU pointer comes from deep inside the launcher."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"{kernel}: every tensor must be on one device; got {tuple(t.shape)} on {t.device} "
                             f"beside {tuple(tensors[0].shape)} on {device}")
    if device.type == "cpu" and not interpreted():
        raise ValueError(f"{kernel} runs on GPU tensors (on the CPU only under TRITON_INTERPRET=1), got tensors on "
                         "the CPU")


def check_flat(*tensors: torch.Tensor) -> int:
    """Check that fp32 optimizer operands are contiguous, one size and on one device; return the size."""
    check_device("the optimizer kernel", *tensors)
    first = tensors[0]
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"expected contiguous float32 tensors, got {t.dtype} {tuple(t.stride())}")
        if t.numel() != first.numel() or t.device != first.device:
            raise ValueError(f"operands differ: {tuple(t.shape)} on {t.device}, {tuple(first.shape)} on "
                             f"{first.device}")
    return first.numel()


def tensor_table(lists: Sequence[Sequence[torch.Tensor]], block: int) -> TensorTable:
    """The (cached) table for parallel tensor lists, e.g. [params, grads, exp_avgs, exp_avg_sqs]."""
    n_tensors = len(lists[0])
    if n_tensors == 0 or any(len(ts) != n_tensors for ts in lists):
        raise ValueError(f"expected non-empty lists of equal length, got lengths {[len(ts) for ts in lists]}")
    tensors = [t for ts in lists for t in ts]
    numels = tuple(t.numel() for t in lists[0])
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or any(
        tuple(t.numel() for t in ts) != numels for ts in lists[1:]
    ):
        raise ValueError("expected lists of contiguous float32 tensors, tensor i of every list of one size")
    key = (block, tensors[0].device, numels, tuple(t.data_ptr() for t in tensors))
    table = _tables.get(key)
    if table is None:
        table = _build(lists, block)
        _tables[key] = table
        if len(_tables) > _CACHE_SIZE:
            _tables.popitem(last=False)
    else:
        _tables.move_to_end(key)
    return table


def _build(lists: Sequence[Sequence[torch.Tensor]], block: int) -> TensorTable:
    device = lists[0][0].device
    check_device("the multi-tensor optimizer kernel", *(t for ts in lists for t in ts))
    addresses = torch.tensor([[t.data_ptr() for t in group] for group in zip(*lists)], dtype=torch.int64)
    numels = torch.tensor([t.numel() for t in lists[0]], dtype=torch.int64)
    blocks = (numels + block - 1) // block
    first_block = torch.cat([torch.zeros(1, dtype=torch.int64), blocks.cumsum(0)])
    num_blocks = int(first_block[-1])
    block_tensor = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    block_index = torch.arange(num_blocks) - first_block[:-1].repeat_interleave(blocks)
    return TensorTable(
        addresses=addresses.to(device),
        numels=numels.to(device),
        block_tensor=block_tensor.to(torch.int32).to(device),
        block_index=block_index.to(torch.int32).to(device),
        first_block=first_block.to(device),
        num_blocks=num_blocks,
        aligned=bool((addresses % 16 == 0).all()),
    )


@triton.jit
def table_block(block_tensor_ptr, block_index_ptr, numels_ptr, BLOCK: tl.constexpr):
    """This program's (tensor, first element, elements left in the tensor from there)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    start = tl.load(block_index_ptr + pid).to(tl.int64) * BLOCK
    return t, start, tl.load(numels_ptr + t) - start


@triton.jit
def table_pointer(addresses_ptr, t, i: tl.constexpr, N_LISTS: tl.constexpr, start, ALIGNED: tl.constexpr):
    """fp32 pointer to element `start` of tensor `t` in list `i`."""
    ptr = tl.load(addresses_ptr + t * N_LISTS + i).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)  # lets the compiler emit 16-byte vector accesses
    return ptr + start
