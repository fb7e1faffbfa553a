"""Data-parallel Adam (CoCoNet's first workload): average the gradients, then update w, m, v."""

import cocoweave as cw


def adam(N: int = 1 << 20) -> cw.Program:
    p = cw.Program("adam")
    g = p.tensor("g", (N,), "float32", cw.Local)
    w = p.tensor("w", (N,), "float32", cw.Replicated)
    m = p.tensor("m", (N,), "float32", cw.Replicated)
    v = p.tensor("v", (N,), "float32", cw.Replicated, init="positive")  # a second moment is >= 0
    lr, b1, b2, eps, step = p.scalars("lr beta1 beta2 eps step")
    g = cw.all_reduce(g, "avg")
    m1 = p.update(m, b1 * m + (1 - b1) * g)
    v1 = p.update(v, b2 * v + (1 - b2) * g * g)
    p.update(w, w - lr * (m1 / (1 - b1**step)) / (cw.sqrt(v1 / (1 - b2**step)) + eps))
    return p
