"""Pipeline-parallel boundary (CoCoNet's third workload): the last layer of a stage ends in an
AllReduce of partial sums, dropout and a residual; the result is sent to the next stage."""

import cocoweave as cw


def boundary(B: int = 8, S: int = 128, H: int = 512) -> cw.Program:
    p = cw.Program("pipeline_parallel")
    this, nxt = p.pipeline(2)  # the world split into two stages; rank i of a stage talks to rank i of the other
    x = p.tensor("x", (B, S, H), "float16", cw.Local, group=this)  # partial sums of a row-parallel matmul
    b = p.tensor("b", (H,), "float16", cw.Replicated, group=this)
    r = p.tensor("r", (B, S, H), "float16", cw.Replicated, group=this)
    y = cw.all_reduce(x, "sum")
    h = cw.dropout(y + b, 0.1, seed=0) + r
    p.output(cw.send(h, nxt), "h")
    return p
