"""Data-parallel LAMB (You et al. 2020): Adam's update direction scaled per tensor by the trust
ratio |w| / |u|. Its norms make reorder insert small all-reduces when the update moves onto slices."""

import cocoweave as cw


def lamb(N: int = 1 << 20) -> cw.Program:
    p = cw.Program("lamb")
    g = p.tensor("g", (N,), "float32", cw.Local)
    w = p.tensor("w", (N,), "float32", cw.Replicated)
    m = p.tensor("m", (N,), "float32", cw.Replicated)
    v = p.tensor("v", (N,), "float32", cw.Replicated, init="positive")
    lr, b1, b2, eps, wd, step = p.scalars("lr beta1 beta2 eps weight_decay step")
    g = cw.all_reduce(g, "avg")
    m1 = p.update(m, b1 * m + (1 - b1) * g)
    v1 = p.update(v, b2 * v + (1 - b2) * g * g)
    u = (m1 / (1 - b1**step)) / (cw.sqrt(v1 / (1 - b2**step)) + eps) + wd * w
    w_norm, u_norm = cw.norm(w), cw.norm(u)
    trust = cw.where(w_norm > 0, cw.where(u_norm > 0, w_norm / u_norm, 1.0), 1.0)
    p.update(w, w - lr * trust * u)
    return p
