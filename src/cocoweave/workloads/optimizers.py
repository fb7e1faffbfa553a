"""Data-parallel optimizer programs: reduce the gradients, then update weights and optimizer state.

Shapes: a flat bucket of `N` elements (SGD, Adam, AdamW); LAMB takes `[N, T]`, T tensors of N
elements side by side, so that its per-tensor trust ratio is a norm over dim 0 (the dim that the
sliced schedules split, which makes reorder insert one small all_reduce of T partial norms).
The formulas follow torch.optim (SGD, Adam, AdamW) and You et al. 2020 (LAMB, Algorithm 2 with
phi = identity) operation by operation, so float32 results agree to rounding.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ProgramError
from ..ir import Local, Program, Replicated, Value
from ..ir.ops import all_reduce, cast, norm, sqrt, where
from ..ir.types import Dim

GRADS = ("local", "reduced")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")
_REDUCTIONS = ("avg", "sum", "adasum")


def _gradient(p: Program, shape: tuple[Dim, ...], grad: str, reduction: str,
              weights: tuple[int, ...] | None = None) -> Value:
    """The reduced gradient: all_reduce of a Local input (weighted by `weights`), or a Replicated input already
    reduced."""
    if grad not in GRADS:
        raise ProgramError(f"program `{p.name}`: grad must be one of {', '.join(GRADS)}, got {grad!r}")
    if reduction not in _REDUCTIONS:
        raise ProgramError(f"program `{p.name}`: reduction must be one of {', '.join(_REDUCTIONS)}, "
                           f"got {reduction!r}")
    if grad == "reduced":
        return p.tensor("g", shape, "float32", Replicated)
    return all_reduce(p.tensor("g", shape, "float32", Local), reduction, weights=weights)


def _weights(p: Program, shape: tuple[Dim, ...], param_dtype: str) -> tuple[Value, Callable[[Value], Value]]:
    """The float32 weights `w` and a function writing their new value (and, for low-precision
    parameters, `p = cast(w)`: `w` is then the master copy)."""
    if param_dtype not in _PARAM_DTYPES:
        raise ProgramError(f"program `{p.name}`: param_dtype must be one of {', '.join(_PARAM_DTYPES)}, "
                           f"got {param_dtype!r}")
    w = p.tensor("w", shape, "float32", Replicated)
    low = None if param_dtype == "float32" else p.tensor("p", shape, param_dtype, Replicated)

    def write(value: Value) -> Value:
        new = p.update(w, value)
        if low is not None:
            p.update(low, cast(new, param_dtype))
        return new

    return w, write


def sgd(N: int = 1 << 20, grad: str = "local", reduction: str = "avg", param_dtype: str = "float32") -> Program:
    """torch.optim.SGD: g += wd * w; buf = momentum * buf + (1 - dampening) * g; step along
    buf (or g + momentum * buf when nesterov = 1). Pass dampening = 0 on the first step (torch
    then sets buf = g) and whenever momentum is 0."""
    p = Program("sgd")
    g = _gradient(p, (N,), grad, reduction)
    w, write = _weights(p, (N,), param_dtype)
    buf = p.tensor("buf", (N,), "float32", Replicated)
    lr, momentum, dampening, wd, nesterov = p.scalars("lr momentum dampening weight_decay nesterov")
    d = g + wd * w
    b1 = p.update(buf, momentum * buf + (1 - dampening) * d)
    write(w - lr * (b1 * (1 - nesterov) + nesterov * (d + momentum * b1)))
    return p


def _moments(p: Program, shape: tuple[Dim, ...], g: Value, b1: Value, b2: Value,
             torch_order: bool = True) -> tuple[Value, Value]:
    """Adam's moments; in torch's order of operations (m.lerp_(g, 1 - b1); v.mul_(b2).addcmul_(g, g,
    1 - b2)) or as the paper writes them (b1 * m + (1 - b1) * g)."""
    m = p.tensor("m", shape, "float32", Replicated)
    v = p.tensor("v", shape, "float32", Replicated, init="positive")  # a second moment is >= 0
    m_new = m + (1 - b1) * (g - m) if torch_order else b1 * m + (1 - b1) * g
    return p.update(m, m_new), p.update(v, b2 * v + (1 - b2) * (g * g))


def adam(N: int = 1 << 20, grad: str = "local", reduction: str = "avg", param_dtype: str = "float32",
         weights: tuple[int, ...] | None = None) -> Program:
    """Data-parallel Adam (CoCoNet's first workload): average the gradients (weighted by `weights`, one positive
    int per rank such as its batch size: HetSeq's per-rank batch), then update w, m, v."""
    p = Program("adam")
    g = _gradient(p, (N,), grad, reduction, weights)
    w, write = _weights(p, (N,), param_dtype)
    lr, b1, b2, eps, step = p.scalars("lr beta1 beta2 eps step")
    m1, v1 = _moments(p, (N,), g, b1, b2, torch_order=False)
    write(w - lr * (m1 / (1 - b1**step)) / (sqrt(v1 / (1 - b2**step)) + eps))
    return p


def adamw(N: int = 1 << 20, grad: str = "local", reduction: str = "avg", param_dtype: str = "float32",
          weights: tuple[int, ...] | None = None) -> Program:
    """torch.optim.AdamW: decoupled weight decay w *= 1 - lr * wd, then the bias-corrected Adam
    step w -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps), in torch's order of operations. `weights` weight the
    gradient average by rank (e.g. by batch size)."""
    p = Program("adamw")
    g = _gradient(p, (N,), grad, reduction, weights)
    w, write = _weights(p, (N,), param_dtype)
    lr, b1, b2, eps, wd, step = p.scalars("lr beta1 beta2 eps weight_decay step")
    m1, v1 = _moments(p, (N,), g, b1, b2)
    step_size = lr / (1 - b1**step)
    denom = sqrt(v1) / (1 - b2**step) ** 0.5 + eps
    write(w * (1 - lr * wd) - step_size * (m1 / denom))
    return p


def lamb(N: int = 1 << 20, T: int | None = None, grad: str = "local", reduction: str = "avg",
         param_dtype: str = "float32") -> Program:
    """Data-parallel LAMB (You et al. 2020): Adam's bias-corrected direction plus weight decay,
    u = m^ / (sqrt(v^) + eps) + wd * w, scaled per tensor by the trust ratio |w| / |u| (1 where
    either norm is 0). 1-dim `[N]` (one tensor) unless T is given: `[N, T]`, T tensors as columns.
    Its norms make reorder insert small all-reduces when the update moves onto slices."""
    p = Program("lamb")
    shape: tuple[Dim, ...] = (N,) if T is None else (N, T)
    g = _gradient(p, shape, grad, reduction)
    w, write = _weights(p, shape, param_dtype)
    lr, b1, b2, eps, wd, step = p.scalars("lr beta1 beta2 eps weight_decay step")
    m1, v1 = _moments(p, shape, g, b1, b2)
    u = (m1 / (1 - b1**step)) / (sqrt(v1 / (1 - b2**step)) + eps) + wd * w
    columns = {} if T is None else {"dim": 0, "keepdim": True}
    w_norm, u_norm = norm(w, **columns), norm(u, **columns)
    trust = where(w_norm > 0, where(u_norm > 0, w_norm / u_norm, 1.0), 1.0)
    write(w - lr * trust * u)
    return p


def reduce_gradient(shape: tuple[Dim, ...] = (1 << 20,), reduction: str = "avg") -> Program:
    """The gradient reduction alone (output `g`): what clipping by global norm needs before any update."""
    p = Program("reduce_gradient")
    p.output(_gradient(p, tuple(shape), "local", reduction), "g")
    return p
