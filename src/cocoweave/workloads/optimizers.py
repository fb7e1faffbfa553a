"""Data-parallel optimizer programs: reduce the gradients, then update weights and optimizer state.

Shapes: a flat bucket of `N` elements (SGD, Adam, AdamW); LAMB takes `[N, T]` (T tensors of N elements as
columns, its trust-ratio norms over dim 0) or, with `rows=True`, `[T, N]` (tensor t is row t, contiguous, so a
bucket of parameters can be viewed without copies; the sliced schedules then give each rank whole rows and the
norms need no communication). The formulas follow torch.optim (SGD, Adam, AdamW) and You et al. 2020 (LAMB,
Algorithm 2 with phi = identity) operation by operation, so float32 results agree to rounding.

Options every program takes:
- `grad`: "local" (all_reduce the ranks' gradients) or "reduced" (already reduced, Replicated).
- `weights` (Adam, AdamW): one positive int per rank, e.g. its batch size (HetSeq's per-rank batch), make the
  "avg" reduction the weighted average sum(w_r g_r) / sum(w_r).
- `param_dtype`: float32, bfloat16 or float16. For low precision, `master_weights=True` keeps float32 weights `w`
  and optimizer state, reduces the gradients in float32 and writes `p = cast(w)` (Megatron's mixed precision);
  `master_weights=False` is torch's
  own semantics: weights and state in the parameters' dtype, each element computed in float32 and rounded once
  (as torch's fused kernels do). The gradient `g` comes in the parameters' dtype.
- `clip=True`: scale the reduced gradient like torch.nn.utils.clip_grad_norm_ by max_norm / (|g| + 1e-6), at most
  1 (runtime scalar `max_norm`). Split and reorder turn |g| into partial sums on the slices plus one small
  all_reduce, like LAMB's norms; cocoweave.optim merges those of all buckets into one.
- `masked=True`: only elements whose `active` input is true are updated (torch skips a parameter without a
  gradient), with a per-element step count `t` (state) for the bias corrections (Adam, AdamW, LAMB) or a
  per-element `started` flag (SGD's momentum buffer starts as the first gradient).
"""

from __future__ import annotations

from ..errors import ProgramError
from ..ir import Local, Program, Replicated, Value
from ..ir.ops import all_reduce, cast, minimum, norm, sqrt, where
from ..ir.types import Dim
from .optimizer_contract import (
    ACTIVE,
    ADAM_SCALARS,
    ADAMW_SCALARS,
    EXP_AVG,
    EXP_AVG_SQ,
    GRAD,
    MAX_NORM,
    MOMENTUM,
    PARAMS,
    SGD_SCALARS,
    STARTED,
    STEPS,
    WEIGHTS,
)

GRADS = ("local", "reduced")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")
_REDUCTIONS = ("avg", "sum", "adasum")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (total_norm + 1e-6)


def _check(p: Program, grad: str, reduction: str, param_dtype: str) -> None:
    if grad not in GRADS:
        raise ProgramError(f"program `{p.name}`: grad must be one of {', '.join(GRADS)}, got {grad!r}")
    if reduction not in _REDUCTIONS:
        raise ProgramError(f"program `{p.name}`: reduction must be one of {', '.join(_REDUCTIONS)}, "
                           f"got {reduction!r}")
    if param_dtype not in _PARAM_DTYPES:
        raise ProgramError(f"program `{p.name}`: param_dtype must be one of {', '.join(_PARAM_DTYPES)}, "
                           f"got {param_dtype!r}")


def _f32(x: Value) -> Value:
    return x if x.dtype == "float32" else cast(x, "float32")


class Parts:
    """What the programs share: the reduced (optionally clipped) float32 gradient, the weights and how their new
    value is written, state tensors in the right dtype, and the `active` mask of a masked program. Public: a new
    optimizer's program (in a file of its own) builds on it and so takes every option above unchanged."""

    def __init__(self, p: Program, shape: tuple[Dim, ...], grad: str, reduction: str, param_dtype: str,
                 master_weights: bool, clip: bool, masked: bool, weights: tuple[int, ...] | None = None):
        _check(p, grad, reduction, param_dtype)
        self.p, self.shape, self.low = p, shape, param_dtype != "float32"
        self.state_dtype = "float32" if master_weights or not self.low else param_dtype
        g = p.tensor(GRAD, shape, param_dtype, Replicated if grad == "reduced" else Local)
        if grad == "local":  # with fp32 masters the gradients are reduced in float32 too (as Megatron does)
            g = _f32(all_reduce(_f32(g), reduction, weights=weights) if master_weights
                     else all_reduce(g, reduction, weights=weights))
        if clip:
            (max_norm,) = p.scalars(MAX_NORM)
            g = g * minimum(max_norm / (norm(g) + CLIP_EPS), 1.0)
        self.g = _f32(g)
        self.active = p.tensor(ACTIVE, shape, "bool", Replicated) if masked else None
        if self.low and master_weights:
            self._w = p.tensor(WEIGHTS, shape, "float32", Replicated)
            self._p = p.tensor(PARAMS, shape, param_dtype, Replicated)
        else:
            self._w, self._p = p.tensor(WEIGHTS, shape, param_dtype, Replicated), None
        self.w = _f32(self._w)

    def state(self, name: str, init: str = "normal", shape: tuple[Dim, ...] | None = None) -> tuple[Value, Value]:
        """A state tensor (the bucket's shape, or `shape`: a factored statistic) and its float32 value."""
        t = self.p.tensor(name, self.shape if shape is None else shape, self.state_dtype, Replicated, init=init)
        return t, _f32(t)

    def keep(self, new: Value, old: Value) -> Value:
        """`new` where the element is active, else the old value (masked programs)."""
        return new if self.active is None else where(self.active, new, old)

    def write(self, t: Value, new: Value) -> Value:
        """Write float32 `new` into state t (rounded to its dtype); returns what later computations read: the
        updated state, or for a low-precision state the float32 value before rounding."""
        if t.dtype != "float32":
            self.p.update(t, cast(new, t.dtype))
            return new
        return self.p.update(t, new)

    def write_weights(self, new: Value) -> None:
        new = self.write(self._w, self.keep(new, self.w))
        if self._p is not None:
            self.p.update(self._p, cast(new, self._p.dtype))

    def steps(self, step: Value) -> Value:
        """The step count to correct biases with: the runtime scalar, or per element `t` + 1 where active."""
        if self.active is None:
            return step
        t = self.p.tensor(STEPS, self.shape, "float32", Replicated, init="positive")
        return self.write(t, t + where(self.active, 1.0, 0.0))



def sgd(N: int = 1 << 20, grad: str = "local", reduction: str = "avg", param_dtype: str = "float32", *,
        master_weights: bool = True, clip: bool = False, masked: bool = False) -> Program:
    """torch.optim.SGD: g += wd * w; buf = momentum * buf + (1 - dampening) * g; step along
    buf (or g + momentum * buf when nesterov = 1). Pass dampening = 0 on the first step with momentum (torch
    then sets buf = g, the buffer being still 0 here) and whenever momentum is 0, when `momentum_on` = 0 leaves the
    buffer as it is (torch neither uses nor changes it); a masked program tracks per element whether it started."""
    p = Program("sgd")
    x = Parts(p, (N,), grad, reduction, param_dtype, master_weights, clip, masked)
    buf, b = x.state(MOMENTUM)
    lr, momentum, dampening, wd, nesterov, on = p.scalars(" ".join(SGD_SCALARS))
    d = x.g + wd * x.w
    damp = dampening
    if masked:
        started = p.tensor(STARTED, (N,), "float32", Replicated, init="unit")
        damp = where(started > 0.5, dampening, 0.0)  # torch's buffer starts as the gradient itself
        x.write(started, where(x.active, started + on - started * on, started))  # started or on (0/1 values)
    b1 = momentum * b + (1 - damp) * d
    kept = x.write(buf, x.keep(on * b1 + (1 - on) * b, b))  # exactly b1 or b for on = 1 or 0
    b1 = on * kept + (1 - on) * b1  # b1 either way (exactly: one term is 0)
    x.write_weights(x.w - lr * (b1 * (1 - nesterov) + nesterov * (d + momentum * b1)))
    return p


def _moments(x: Parts, b1: Value, b2: Value, torch_order: bool = True) -> tuple[Value, Value]:
    """Adam's moments; in torch's order of operations (m.lerp_(g, 1 - b1); v.mul_(b2).addcmul_(g, g,
    1 - b2)) or as the paper writes them (b1 * m + (1 - b1) * g)."""
    m, mf = x.state(EXP_AVG)
    v, vf = x.state(EXP_AVG_SQ, init="positive")  # a second moment is >= 0
    m_new = mf + (1 - b1) * (x.g - mf) if torch_order else b1 * mf + (1 - b1) * x.g
    return x.write(m, x.keep(m_new, mf)), x.write(v, x.keep(b2 * vf + (1 - b2) * (x.g * x.g), vf))


def adam(N: int = 1 << 20, grad: str = "local", reduction: str = "avg", param_dtype: str = "float32", *,
         master_weights: bool = True, clip: bool = False, masked: bool = False,
         weights: tuple[int, ...] | None = None) -> Program:
    """Data-parallel Adam (CoCoNet's first workload): average the gradients (weighted by `weights`), then update
    w, m, v."""
    p = Program("adam")
    x = Parts(p, (N,), grad, reduction, param_dtype, master_weights, clip, masked, weights)
    lr, b1, b2, eps, step = p.scalars(" ".join(ADAM_SCALARS))
    m1, v1 = _moments(x, b1, b2, torch_order=False)
    t = x.steps(step)
    x.write_weights(x.w - lr * (m1 / (1 - b1**t)) / (sqrt(v1 / (1 - b2**t)) + eps))
    return p


def adamw(N: int = 1 << 20, grad: str = "local", reduction: str = "avg", param_dtype: str = "float32", *,
          master_weights: bool = True, clip: bool = False, masked: bool = False,
          weights: tuple[int, ...] | None = None, decoupled: bool = True) -> Program:
    """torch.optim.AdamW: decoupled weight decay w *= 1 - lr * wd, then the bias-corrected Adam
    step w -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps), in torch's order of operations. With
    decoupled=False it is torch.optim.Adam: L2 weight decay added to the gradient, g += wd * w."""
    p = Program("adamw" if decoupled else "adam_l2")
    x = Parts(p, (N,), grad, reduction, param_dtype, master_weights, clip, masked, weights)
    lr, b1, b2, eps, wd, step = p.scalars(" ".join(ADAMW_SCALARS))
    if not decoupled:
        x.g = x.g + wd * x.w
    m1, v1 = _moments(x, b1, b2)
    t = x.steps(step)
    step_size = lr / (1 - b1**t)
    denom = sqrt(v1) / (1 - b2**t) ** 0.5 + eps
    x.write_weights((x.w * (1 - lr * wd) if decoupled else x.w) - step_size * (m1 / denom))
    return p


def lamb(N: int = 1 << 20, T: int | None = None, grad: str = "local", reduction: str = "avg",
         param_dtype: str = "float32", *, master_weights: bool = True, rows: bool = False, clip: bool = False,
         masked: bool = False) -> Program:
    """Data-parallel LAMB (You et al. 2020): Adam's bias-corrected direction plus weight decay,
    u = m^ / (sqrt(v^) + eps) + wd * w, scaled per tensor by the trust ratio |w| / |u| (1 where
    either norm is 0). 1-dim `[N]` (one tensor) unless T is given: `[N, T]`, T tensors as columns, or
    `[T, N]` with `rows`. Its norms make reorder insert small all-reduces when the update moves onto slices."""
    p = Program("lamb")
    shape: tuple[Dim, ...] = (N,) if T is None else ((T, N) if rows else (N, T))
    x = Parts(p, shape, grad, reduction, param_dtype, master_weights, clip, masked)
    lr, b1, b2, eps, wd, step = p.scalars(" ".join(ADAMW_SCALARS))
    m1, v1 = _moments(x, b1, b2)
    t = x.steps(step)
    u = (m1 / (1 - b1**t)) / (sqrt(v1 / (1 - b2**t)) + eps) + wd * x.w
    per_tensor = {} if T is None else {"dim": 1 if rows else 0, "keepdim": True}
    w_norm, u_norm = norm(x.w, **per_tensor), norm(u, **per_tensor)
    trust = where(w_norm > 0, where(u_norm > 0, w_norm / u_norm, 1.0), 1.0)
    x.write_weights(x.w - lr * trust * u)
    return p


def reduce_gradient(shape: tuple[Dim, ...] = (1 << 20,), reduction: str = "avg") -> Program:
    """The gradient reduction alone (output `g`)."""
    p = Program("reduce_gradient")
    p.output(all_reduce(p.tensor(GRAD, tuple(shape), "float32", Local), reduction), GRAD)
    return p




def adam_l2(N: int = 1 << 20, grad: str = "local", reduction: str = "avg", param_dtype: str = "float32",
            **options) -> Program:
    """torch.optim.Adam (L2 weight decay added to the gradient): adamw with decoupled=False."""
    return adamw(N, grad, reduction, param_dtype, decoupled=False, **options)
