"""A tensor-parallel pre-LayerNorm transformer block (attention heads and MLP columns split across a group)
and the single-process block with the same parameters and the same dropout masks.

    x = x + dropout(proj(attention(ln1(x))))        proj: RowParallelLinear with the fused epilogue
    x = x + dropout(fc2(gelu(fc1(ln2(x)))))         fc1: ColumnParallelLinear, fc2: RowParallelLinear

Dropout draws a fresh mask every training step: forward(x, step=s) derives both epilogues' seeds from (seed, s);
without `step` a block counts its own training forwards.

The fused q/k/v weight has its output features ordered (head, {q, k, v}, head_dim), so a contiguous slice
holds whole heads with their own q, k and v (Megatron's layout); each rank attends over its heads only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import rng
from ..errors import ParallelConfigError
from ..sharding import local, local_data, replicate_parameters, tp_mesh
from .functional import (
    Group,
    gather_from_parallel,
    group_rank,
    group_size,
    mix_seed,
    scatter_to_parallel,
    sum_grads,
)
from .layers import ColumnParallelLinear, DropoutCounter, RowParallelLinear, full_linear_weights, resolve_group


def _check_heads(d_model: int, n_heads: int, tp: int) -> int:
    if d_model % n_heads:
        raise ParallelConfigError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
    if n_heads % tp:
        raise ParallelConfigError(f"{n_heads} attention heads cannot be split evenly over {tp} tensor-parallel ranks")
    return d_model // n_heads


def _attend(qkv: torch.Tensor, heads: int, head_dim: int, causal: bool) -> torch.Tensor:
    """Attention of (B, T, heads * 3 * head_dim) fused projections ordered (head, qkv, dim) -> (B, T, heads*dim)."""
    B, T = qkv.shape[:2]
    q, k, v = qkv.view(B, T, heads, 3, head_dim).permute(3, 0, 2, 1, 4).unbind(0)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return a.transpose(1, 2).reshape(B, T, heads * head_dim)


def block_seeds(seed: int, step: int) -> tuple[int, int]:
    """Dropout seeds of a block's two epilogues (attention, MLP) at training step `step`."""
    return mix_seed(seed, step, 0), mix_seed(seed, step, 1)


def _next_step(block: nn.Module, step: int | None) -> int:
    """The step whose dropout masks a block's forward draws: `step` when the caller passes it (the training
    step: a resumed run draws the same masks), else the block's own count of training forwards, advanced here."""
    if step is not None:
        return step
    step = block.dropout_step
    block.dropout_step += block.training
    return step


LINEARS = ("qkv", "proj", "fc1", "fc2")  # a block's linear layers; layer i's weights are drawn from seed + i


class ReferenceBlock(DropoutCounter, nn.Module):
    """The block in one process with full-size torch.nn layers; dropout uses cocoweave's counter-based
    mask at logical indices `index_offset + i`, like the parallel block."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, dropout: float = 0.0, *,
                 causal: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.head_dim = _check_heads(d_model, n_heads, 1)
        self.n_heads, self.p, self.causal, self.seed = n_heads, dropout, causal, seed
        self.dropout_step = 0  # training forwards without a `step` so far (see _next_step)
        d_ff = d_ff or 4 * d_model
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """LayerNorms to ones and zeros, linear layer i to `full_linear_weights(..., seed + i)`: the weights a
        TransformerBlock of the same seed holds parts of, at every tensor-parallel size."""
        self.ln1.reset_parameters()
        self.ln2.reset_parameters()
        for i, name in enumerate(LINEARS):
            lin = getattr(self, name)
            w, b = full_linear_weights(lin.in_features, lin.out_features, True, self.seed + i)
            lin.weight.copy_(w)
            lin.bias.copy_(b)

    def _dropout(self, y: torch.Tensor, seed: int, offset: int) -> torch.Tensor:
        if not self.training or self.p == 0:
            return y
        index = torch.arange(offset, offset + y.numel(), device=y.device).reshape(y.shape)
        return rng.dropout(y, index, self.p, seed)

    def forward(self, x: torch.Tensor, *, step: int | None = None, index_offset: int = 0) -> torch.Tensor:
        s_attn, s_mlp = block_seeds(self.seed, _next_step(self, step))
        a = _attend(self.qkv(self.ln1(x)), self.n_heads, self.head_dim, self.causal)
        x = self._dropout(self.proj(a), s_attn, index_offset) + x
        h = F.gelu(self.fc1(self.ln2(x)))
        return self._dropout(self.fc2(h), s_mlp, index_offset) + x


class TransformerBlock(DropoutCounter, nn.Module):
    """The block with attention heads and MLP hidden units split across `group` (tensor parallelism):
    two all-reduces forward (after attention and after the MLP, fused with bias, dropout and residual)
    and two backward. Input and output are replicated over the group."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, dropout: float = 0.0, *,
                 group: Group = None, causal: bool = True, overlap_chunks: int = 1, seed: int = 0,
                 device: Any = None, dtype: torch.dtype | None = None, schedule: str | dict[str, str] | None = "auto",
                 sequence_parallel: bool = False) -> None:
        """`schedule`: one for every layer ("auto", the default: measured per layer, the fastest checked path; None /
        "as written": the hand-written path; a schedule's name)
        or a dict by layer name ("qkv", "proj", "fc1", "fc2"). `sequence_parallel`: the block takes and returns
        this rank's token slice (see forward), its LayerNorms and epilogues work on slices (Megatron-SP)."""
        super().__init__()
        mesh = tp_mesh(group)
        group = resolve_group(group)  # a DeviceMesh's "tp" dim
        tp = group_size(group)
        self.head_dim = _check_heads(d_model, n_heads, tp)
        self.local_heads, self.causal, self.seed, self.group = n_heads // tp, causal, seed, group
        self.dropout_step = 0  # training forwards without a `step` so far (see _next_step)
        d_ff = d_ff or 4 * d_model
        self.sequence_parallel, self.d_model = bool(sequence_parallel), d_model
        per = schedule if isinstance(schedule, dict) else dict.fromkeys(LINEARS, schedule)
        kw: dict[str, Any] = {"group": group, "device": device, "dtype": dtype, "sequence_parallel": sequence_parallel}
        self.ln1 = replicate_parameters(nn.LayerNorm(d_model, device=device, dtype=dtype), mesh)
        self.ln2 = replicate_parameters(nn.LayerNorm(d_model, device=device, dtype=dtype), mesh)
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, seed=seed, schedule=per.get("qkv"), **kw)
        self.proj = RowParallelLinear(d_model, d_model, dropout=dropout, overlap_chunks=overlap_chunks,
                                      seed=seed + 1, schedule=per.get("proj"), **kw)
        self.fc1 = ColumnParallelLinear(d_model, d_ff, seed=seed + 2, schedule=per.get("fc1"), **kw)
        self.fc2 = RowParallelLinear(d_ff, d_model, dropout=dropout, overlap_chunks=overlap_chunks,
                                     seed=seed + 3, schedule=per.get("fc2"), **kw)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """LayerNorms to ones and zeros, each linear layer to its part of the weights ReferenceBlock(seed) holds."""
        for ln in (self.ln1, self.ln2):
            local_data(ln.weight).fill_(1)
            local_data(ln.bias).zero_()
        for name in LINEARS:
            getattr(self, name).reset_parameters()

    @torch.no_grad()
    def load_reference(self, ref: ReferenceBlock) -> TransformerBlock:
        """Take this rank's part of a single-process block's parameters (and its dropout seed); returns self."""
        for mine, theirs in ((self.ln1, ref.ln1), (self.ln2, ref.ln2)):
            local_data(mine.weight).copy_(theirs.weight)
            local_data(mine.bias).copy_(theirs.bias)
        for name in LINEARS:
            full = getattr(ref, name)
            getattr(self, name).load_full(full.weight, full.bias)
        self.seed, self.dropout_step = ref.seed, ref.dropout_step
        return self

    def forward(self, x: torch.Tensor, *, step: int | None = None, index_offset: int = 0,
                batch_shape: tuple[int, int] | None = None) -> torch.Tensor:
        """The block on replicated (batch, seq, d_model) input; with sequence parallelism on this rank's token slice
        (rows of the (batch * seq, d_model) input, torch.tensor_split parts: `sequence_slice`) given its
        `batch_shape` (batch, seq), returning the output's slice."""
        s_attn, s_mlp = block_seeds(self.seed, _next_step(self, step))
        if not self.sequence_parallel:
            a = _attend(self.qkv(self._norm(self.ln1, x)), self.local_heads, self.head_dim, self.causal)
            x = self.proj(a, residual=x, dropout_seed=s_attn, index_offset=index_offset)
            h = F.gelu(self.fc1(self._norm(self.ln2, x)))
            return self.fc2(h, residual=x, dropout_seed=s_mlp, index_offset=index_offset)
        if batch_shape is None:
            raise ParallelConfigError("TransformerBlock: with sequence_parallel=True, forward takes this rank's token "
                                      "slice and needs batch_shape=(batch, seq)")
        B, T = batch_shape
        rows = B * T
        want = (self.qkv.programs.part_rows(rows), self.d_model)
        if tuple(x.shape) != want:
            raise ParallelConfigError(f"TransformerBlock: sequence-parallel input has shape {list(x.shape)}, expected "
                                      f"{list(want)} (rank {group_rank(self.group)}'s part of {rows} tokens)")
        qkv = self.qkv(self._norm(self.ln1, x), tokens=rows)
        a = _attend(qkv.view(B, T, -1), self.local_heads, self.head_dim, self.causal).reshape(rows, -1)
        x = self.proj(a, residual=x, dropout_seed=s_attn, index_offset=index_offset)
        h = F.gelu(self.fc1(self._norm(self.ln2, x), tokens=rows))
        return self.fc2(h, residual=x, dropout_seed=s_mlp, index_offset=index_offset)

    def _norm(self, ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm on this rank's tensors of its (replicated) parameters; on a token slice its parameters'
        gradients are summed over the group (Megatron-SP), by the programs of the layer after it."""
        w, b = local(ln.weight), local(ln.bias)
        if self.sequence_parallel:
            w, b = sum_grads((self.qkv if ln is self.ln1 else self.fc1).programs, w, b)
        return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)

    def extra_repr(self) -> str:
        return f"heads={self.local_heads} of {self.local_heads * group_size(self.group)} on rank " \
               f"{group_rank(self.group)}" + (", sequence_parallel=True" if self.sequence_parallel else "")


def sequence_slice(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """This rank's token slice of a replicated (batch, seq, d) tensor: rows of its (batch * seq, d) view, in
    torch.tensor_split parts (the input of a sequence-parallel block); the backward all-gathers the gradient."""
    return scatter_to_parallel(x.reshape(-1, x.shape[-1]), 0, group)


def sequence_gather(x: torch.Tensor, batch_shape: tuple[int, int], group: Group = None) -> torch.Tensor:
    """The replicated (batch, seq, d) tensor from every rank's token slice (equal slices: batch * seq divisible by
    the group size); the backward keeps this rank's slice of the gradient."""
    rows = batch_shape[0] * batch_shape[1]
    if rows % group_size(group):
        raise ParallelConfigError(f"sequence_gather: {rows} tokens do not split evenly over {group_size(group)} "
                                  "ranks; gather uneven slices with the next block's programs instead")
    return gather_from_parallel(x, 0, group).view(*batch_shape, x.shape[-1])
