"""The cocoweave programs behind the tensor-parallel layers: the forward and the backward of a row- and a
column-parallel linear layer (matmul, the collective, bias + dropout + residual), each a DSL program over the
tensor-parallel group, built once per shape, dtype and options.

Activations are 2-D (rows = tokens, features). Weights enter transposed where the program multiplies by Wᵀ
(`w` is then a view, never a copy). Dropout draws cocoweave's counter-based mask at logical index
`offset + row * features + column` of the layer's output, as `rng.dropout` does, in every schedule.

Sequence parallelism (Korthikanti et al. 2022) is the `sp=True` form: the row-parallel all-reduce becomes a
reduce-scatter over tokens with the epilogue on this rank's token slice (CoCoNet's split + reorder), its
all-gather moved to the next column-parallel layer's input (after the LayerNorm, which runs on slices).
"""

from __future__ import annotations

import functools

from ..ir import Local, Program, Replicated, Sliced
from ..ir.ops import all_gather, all_reduce, dropout, matmul, reduce_scatter
from ..ir.ops import sum as reduce_sum

ASYNC = "MM-AR||MMw"  # the column backward's input-gradient all-reduce in flight during the weight-gradient matmul
ASYNC_SHM = "MM-AR@shm||MMw"  # the same on shared memory: the slots summed after the weight-gradient matmul


def _epilogue(p: Program, y, bias: bool, drop: float, residual, d_out: int, dtype: str):  # noqa: ANN001, ANN202
    """dropout(y + b, seed, offset) + residual on `y`'s layout (the bias replicated)."""
    if bias:
        y = y + p.tensor("b", (d_out,), dtype, Replicated)
    if drop > 0:
        y = dropout(y, drop, seed=p.scalar("seed", "int64"), offset=p.scalar("offset", "int64"))
    return y if residual is None else y + residual


@functools.lru_cache(maxsize=256)
def row_forward(rows: int, d_in: int, d_out: int, dtype: str = "float32", drop: float = 0.0, bias: bool = True,
                residual: bool = True, sp: bool = False) -> Program:
    """out = dropout(all_reduce(x @ w) + b) + r, x sliced on features, w = Wᵀ sliced on its rows; with `sp` the
    sum is reduce-scattered over tokens and out (and r) are this rank's token slice."""
    p = Program("row_parallel_forward" + ("_sp" if sp else ""))
    x = p.tensor("x", (rows, d_in), dtype, Sliced(1))
    w = p.tensor("w", (d_in, d_out), dtype, Sliced(0))
    r = p.tensor("r", (rows, d_out), dtype, Sliced(0) if sp else Replicated) if residual else None
    y = matmul(x, w)
    y = reduce_scatter(y, "sum", 0) if sp else all_reduce(y, "sum")
    p.output(_epilogue(p, y, bias, drop, r, d_out, dtype), "out")
    return p


@functools.lru_cache(maxsize=256)
def row_backward(rows: int, d_in: int, d_out: int, dtype: str = "float32", drop: float = 0.0, bias: bool = True,
                 sp: bool = False) -> Program:
    """The row-parallel layer's gradients from its output's `g`: the dropout mask recomputed (gy, output for the
    weight gradient gyᵀ x, which the caller multiplies), gx = gy W (sliced like x), gb = Σ gy; with `sp`, g is a
    token slice and gy is all-gathered first."""
    p = Program("row_parallel_backward" + ("_sp" if sp else ""))
    g = p.tensor("g", (rows, d_out), dtype, Sliced(0) if sp else Replicated)
    w = p.tensor("w", (d_out, d_in), dtype, Sliced(1))
    gy = dropout(g, drop, seed=p.scalar("seed", "int64"), offset=p.scalar("offset", "int64")) if drop > 0 else g
    if sp:
        gy = all_gather(gy, 0)
    if gy is not g:
        p.output(gy, "gy")
    p.output(matmul(gy, w), "gx")
    if bias:
        p.output(reduce_sum(gy, 0), "gb")
    return p


@functools.lru_cache(maxsize=256)
def column_forward_sp(rows: int, d_in: int, d_out: int, dtype: str = "float32") -> Program:
    """Sequence parallelism's column-parallel input: this rank's token slice all-gathered, then x @ w with
    w = Wᵀ sliced on its columns (the bias is added outside, on the sliced output)."""
    p = Program("column_parallel_forward_sp")
    x = p.tensor("x", (rows, d_in), dtype, Sliced(0))
    w = p.tensor("w", (d_in, d_out), dtype, Sliced(1))
    xg = all_gather(x, 0)
    p.output(matmul(xg, w), "y")
    p.output(xg, "xg")  # the gathered input, kept for the weight gradient
    return p


@functools.lru_cache(maxsize=256)
def column_backward(rows: int, d_in: int, d_out: int, dtype: str = "float32", bias: bool = True,
                    sp: bool = False) -> Program:
    """The column-parallel layer's gradients: gx = all_reduce(gy W) (Megatron's f backward; with `sp` a
    reduce-scatter over tokens), gw = gyᵀ x (gyt: gy's transposed view), gb = Σ gy; gy sliced on features, W on
    its rows, x the whole input (with `sp`: the gathered one)."""
    p = Program("column_parallel_backward" + ("_sp" if sp else ""))
    gy = p.tensor("gy", (rows, d_out), dtype, Sliced(1))
    gyt = p.tensor("gyt", (d_out, rows), dtype, Sliced(0))
    w = p.tensor("w", (d_out, d_in), dtype, Sliced(0))
    x = p.tensor("x", (rows, d_in), dtype, Replicated)
    gx = matmul(gy, w)
    p.output(reduce_scatter(gx, "sum", 0) if sp else all_reduce(gx, "sum"), "gx")
    p.output(matmul(gyt, x), "gw")
    if bias:
        p.output(reduce_sum(gy, 0), "gb")
    return p


@functools.lru_cache(maxsize=256)
def grad_all_reduce(rows: int, d_in: int, dtype: str = "float32", sp: bool = False) -> Program:
    """The input gradient's reduction alone (its partial sums an input): what Megatron's asynchronous gradient
    all-reduce launches before the weight-gradient matmul and waits for after it."""
    p = Program("input_grad_reduce" + ("_sp" if sp else ""))
    g = p.tensor("g", (rows, d_in), dtype, Local)
    p.output(reduce_scatter(g, "sum", 0) if sp else all_reduce(g, "sum"), "gx")
    return p


@functools.lru_cache(maxsize=256)
def moe_forward(ranks: int, experts: int, rows: int, dim: int, hidden: int, capacity: int,
                dtype: str = "float32") -> Program:
    """The MoE layer's dropless experts (workloads.moe_dropless with `save`): this rank's `rows` routed rows in,
    sorted by (destination rank, local expert); dispatch, SwiGLU as grouped_matmul, combine; `capacity` rows a
    rank may receive. Also outputs what moe_backward takes (the received rows, the two first GEMMs' results and the
    last one's operand)."""
    from ..workloads import moe_dropless

    return moe_dropless(R=ranks, E=experts, N=rows, D=dim, F=hidden, M=capacity, dtype=dtype, save=True)


@functools.lru_cache(maxsize=256)
def moe_backward(ranks: int, experts: int, rows: int, dim: int, hidden: int, capacity: int,
                 dtype: str = "float32") -> Program:
    """moe_forward's gradients (workloads.moe_dropless_backward): the rows' and this rank's experts'."""
    from ..workloads import moe_dropless_backward

    return moe_dropless_backward(R=ranks, E=experts, N=rows, D=dim, F=hidden, M=capacity, dtype=dtype)
