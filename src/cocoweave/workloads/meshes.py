"""A transformer MLP block, out = x + dropout(relu(x @ w1 + b1) @ w2 + b2), in 1-D, 2-D and 3-D tensor parallelism.

- `mlp_1d` (Megatron, world p): x Replicated, w1 split by columns, w2 by rows; one all_reduce of the
  activations per block, whatever p is.
- `mlp_2d` (SUMMA / Optimus style, a q x q mesh): activations and weights are q x q blocks. The first matmul
  gathers this rank's row panel of x (over y) and column panel of w1 (over x); the second gathers w2's panel
  and all-reduces the partial sums over y. Every rank moves O(1/q) of the activations and weights.
- `mlp_3d` (Bian et al. 2021 / Colossal-AI, a q x q x q cube): the three axes take turns as the row, inner and
  column axis of each matmul; activations and weights are split over all q^3 ranks, each matmul gathers one
  operand over one axis and reduces over another, and every rank moves O(1/q^2).

The block's output has the input's layout, so blocks stack. Half of each schedule's interest is the final
all_reduce: split along a free dimension and reordered, the epilogue runs on slices (CoCoNet, per mesh axis).
"""

from __future__ import annotations

from ..ir import Layout, Program, Replicated, Sliced
from ..ir.ops import all_gather, all_reduce, dropout, matmul, maximum, reduce_scatter


def mlp_1d(B: int = 8, S: int = 16, H: int = 32, dtype: str = "float32", p_drop: float = 0.1) -> Program:
    """Megatron MLP on the whole world: column-parallel w1, row-parallel w2, one all_reduce."""
    F = 4 * H
    p = Program("tp1d_mlp")
    x = p.tensor("x", (B, S, H), dtype, Replicated)
    w1 = p.tensor("w1", (H, F), dtype, Sliced(1))
    b1 = p.tensor("b1", (F,), dtype, Sliced(0))
    w2 = p.tensor("w2", (F, H), dtype, Sliced(0))
    b2 = p.tensor("b2", (H,), dtype, Replicated)
    h = maximum(matmul(x, w1) + b1, 0.0)  # Sliced(2): this rank's columns
    y = all_reduce(matmul(h, w2), "sum")  # Local partial sums -> Replicated
    p.output(dropout(y + b2, p_drop, seed=0) + x, "out")
    return p


def mlp_2d(B: int = 8, S: int = 16, H: int = 32, q: int = 2, dtype: str = "float32",
           p_drop: float = 0.1) -> Program:
    """SUMMA / Optimus MLP on a q x q mesh (x: rows of the batch, y: columns of the hidden dimension)."""
    F = 4 * H
    p = Program("tp2d_mlp")
    p.mesh(x=q, y=q)
    x = p.tensor("x", (B, S, H), dtype, Layout(x=Sliced(0), y=Sliced(2)))  # block (i, j) on rank (i, j)
    w1 = p.tensor("w1", (H, F), dtype, Layout(x=Sliced(0), y=Sliced(1)))
    b1 = p.tensor("b1", (F,), dtype, Layout(y=Sliced(0)))
    w2 = p.tensor("w2", (F, H), dtype, Layout(x=Sliced(1), y=Sliced(0)))
    b2 = p.tensor("b2", (H,), dtype, Replicated)
    rows = all_gather(x, axis="y")  # row panel i of x: [B/q, S, H]
    cols = all_gather(w1, axis="x")  # column panel j of w1: [H, F/q]
    h = maximum(matmul(rows, cols) + b1, 0.0)  # block (i, j) of the hidden activations
    y = all_reduce(matmul(h, all_gather(w2, axis="x")), "sum", axis="y")  # partial sums over j
    p.output(dropout(y + b2, p_drop, seed=0) + x, "out")  # back to x's blocks
    return p


def mlp_3d(B: int = 8, S: int = 8, H: int = 16, q: int = 2, dtype: str = "float32",
           p_drop: float = 0.1) -> Program:
    """3-D MLP on a q x q x q cube. First matmul: z splits the rows, x the inner dimension, y the columns;
    second: z the rows, y the inner dimension, x the columns (the axes trade roles, as in Colossal-AI)."""
    F = 4 * H
    p = Program("tp3d_mlp")
    p.mesh(x=q, y=q, z=q)
    act = Layout(x=Sliced(2), y=Sliced(1), z=Sliced(0))  # every activation element on one rank
    x = p.tensor("x", (B, S, H), dtype, act)
    w1 = p.tensor("w1", (H, F), dtype, Layout(x=Sliced(0), y=Sliced(1), z=Sliced(0)))
    b1 = p.tensor("b1", (F,), dtype, Layout(y=Sliced(0)))
    w2 = p.tensor("w2", (F, H), dtype, Layout(x=Sliced(1), y=Sliced(0), z=Sliced(1)))
    b2 = p.tensor("b2", (H,), dtype, Layout(x=Sliced(0)))
    xs = all_gather(x, axis="y")  # the sequence back whole: [B/q, S, H/q]
    h = matmul(xs, all_gather(w1, axis="z"))  # partial sums over x: [B/q, S, F/q]
    h = maximum(reduce_scatter(h, "sum", dim=1, axis="x") + b1, 0.0)  # x splits the sequence now
    y = matmul(all_gather(h, axis="x"), all_gather(w2, axis="z"))  # partial sums over y: [B/q, S, H/q]
    y = all_reduce(y, "sum", axis="y")
    p.output(dropout(y + b2, p_drop, seed=0) + x, "out")
    return p


def mlp_torch(x, w1, b1, w2, b2, p_drop: float = 0.1, seed: int = 0):
    """The same block in one process with plain torch ops (the dropout mask by cocoweave's counter-based hash
    of each element's logical index, as every backend draws it)."""
    import torch

    from .. import rng

    h = torch.clamp(x.float() @ w1.float() + b1.float(), min=0.0)
    y = h @ w2.float() + b2.float()
    y = rng.dropout(y, rng.logical_index(tuple(y.shape), y.device), p_drop, seed, rng.NO_RANK)
    return (y + x.float()).to(x.dtype)
