"""Model- and pipeline-parallel workloads (CoCoNet's second and third).

- `layer`: a Megatron-style row-parallel block. The input is sliced along its last dim and the
  weight along its first, so the matmul gives per-rank partial sums; AllReduce them, add the
  bias, dropout, add the residual. The schedules overlap the matmul with the collective and move
  the epilogue onto slices between a ReduceScatter and an AllGather.
- `boundary`: the last layer of a pipeline stage ends in the same AllReduce + bias + dropout +
  residual, and its result is sent to the next stage. CoCoNet's schedule (`RS-C-P2P-AG`) splits
  the AllReduce, runs the epilogue on slices, sends only the slices and all-gathers on the
  receiving stage: point-to-point traffic drops by the tensor-parallel degree.

Both draw their dropout mask from a runtime scalar `seed` that the caller changes every step (a training run
needs a fresh mask each step); `seed=<int>` makes it a program constant (the same mask every step).
"""

from __future__ import annotations

from ..ir import Local, Program, Replicated, Sliced
from ..ir.graph import Value
from ..ir.ops import all_reduce, dropout, matmul, send


def _seed(p: Program, seed: int | None) -> Value | int:
    """The dropout seed: a runtime scalar `seed` (a fresh mask each step, as training needs) unless a constant
    is given (the same mask every step)."""
    return p.scalar("seed", "int64") if seed is None else seed


def layer(B: int = 8, S: int = 128, H: int = 512, dtype: str = "float16", p_drop: float = 0.1,
          seed: int | None = None) -> Program:
    """Megatron-style row-parallel block: out = dropout(all_reduce(x @ w) + b, seed) + r."""
    p = Program("model_parallel")
    x = p.tensor("x", (B, S, H), dtype, Sliced(2))
    w = p.tensor("w", (H, H), dtype, Sliced(0))
    b = p.tensor("b", (H,), dtype, Replicated)
    r = p.tensor("r", (B, S, H), dtype, Replicated)
    y = all_reduce(matmul(x, w), "sum")  # Local partial sums -> Replicated
    p.output(dropout(y + b, p_drop, seed=_seed(p, seed)) + r, "out")
    return p


def boundary(B: int = 8, S: int = 128, H: int = 512, dtype: str = "float16", p_drop: float = 0.1,
             seed: int | None = None) -> Program:
    """Pipeline-stage boundary: h = dropout(all_reduce(x) + b, seed) + r, sent to the next stage."""
    p = Program("pipeline_parallel")
    this, nxt = p.pipeline(2)  # the world split into two stages; rank i of a stage talks to rank i of the other
    x = p.tensor("x", (B, S, H), dtype, Local, group=this)  # partial sums of a row-parallel matmul
    b = p.tensor("b", (H,), dtype, Replicated, group=this)
    r = p.tensor("r", (B, S, H), dtype, Replicated, group=this)
    h = dropout(all_reduce(x, "sum") + b, p_drop, seed=_seed(p, seed)) + r
    p.output(send(h, nxt), "h")
    return p
