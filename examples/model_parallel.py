"""Megatron-style row-parallel block (CoCoNet's second workload): a matmul on sliced weights gives
per-rank partial sums; AllReduce them, add the bias, dropout, add the residual."""

import cocoweave as cw


def layer(B: int = 8, S: int = 128, H: int = 512) -> cw.Program:
    p = cw.Program("model_parallel")
    x = p.tensor("x", (B, S, H), "float16", cw.Sliced(2))
    w = p.tensor("w", (H, H), "float16", cw.Sliced(0))
    b = p.tensor("b", (H,), "float16", cw.Replicated)
    r = p.tensor("r", (B, S, H), "float16", cw.Replicated)
    y = cw.all_reduce(cw.matmul(x, w), "sum")  # Local partial sums -> Replicated
    p.output(cw.dropout(y + b, 0.1, seed=0) + r, "out")
    return p
