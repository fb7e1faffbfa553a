"""DistributedAdamW, DistributedLAMB and DistributedSGD: torch.optim.Optimizer subclasses that replace
DDP + optimizer. Call loss.backward() on the plain model, then step(): each bucket's compiled program reduces
the gradients (from backward hooks, while backward goes on) and updates weights and state with its schedule."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, Unpack

import torch

from ..errors import OptimizerError
from ..workloads.optimizer_contract import ADAM_STATE, ADAMW_SCALARS, SGD_SCALARS, SGD_STATE, STARTED
from ..workloads.optimizers import adam_l2, adamw, lamb, sgd
from .base import DistributedOptimizer
from .buckets import Bucket


class DistributedOptions(TypedDict, total=False):
    """The options every distributed optimizer takes beside its hyperparameters (DistributedAdamW says what each
    does)."""

    schedule: str
    reduction: str
    max_grad_norm: float | None
    process_group: Any
    bucket_cap_mb: float
    overlap: bool
    gather: str
    master_weights: bool
    kernels: str | None
    module: torch.nn.Module | None
    broadcast_buffers: bool


# torch.optim's implementation switches: one fused program runs every step here, so they change nothing; and its
# options accepted when off, refused with what to do when on
_IGNORED = ("fused", "foreach", "decoupled_weight_decay")
_UNSUPPORTED = {"amsgrad": "amsgrad=True is not supported yet; use amsgrad=False",
                "maximize": "maximize=True is not supported yet; minimise the negated loss instead",
                "capturable": "capturable=True is not supported (the step runs one compiled program per bucket); "
                              "leave it False",
                "differentiable": "differentiable=True is not supported (the step runs one compiled program per "
                                  "bucket); leave it False"}


def _options(name: str, options: dict[str, Any], torch_names: bool = True) -> dict[str, Any]:
    """The distributed options among `options`. torch.optim's keyword arguments that mean the same here are accepted
    (`torch_names`), those that do not are refused with a sentence, as is any other name."""
    ours = {}
    for key, value in options.items():
        if key in DistributedOptions.__annotations__:
            ours[key] = value
        elif torch_names and key in _UNSUPPORTED and value:
            raise OptimizerError(f"{name}: {_UNSUPPORTED[key]}")
        elif not (torch_names and (key in _IGNORED or key in _UNSUPPORTED)):
            raise OptimizerError(f"{name}: unknown argument {key!r}")
    return ours


_TORCH_FLAGS = (*_IGNORED, *_UNSUPPORTED)


def _refuse_flags(name: str, group: dict[str, Any]) -> None:
    """A group (made, added, or loaded from a torch state dict) asking for a torch flag this optimizer does not
    implement is refused with what to do."""
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(key):
            raise OptimizerError(f"{name}: {_UNSUPPORTED[key]}")


def _torch_keys(torch_class: type[torch.optim.Optimizer], options: dict[str, Any]) -> dict[str, Any]:
    """The flags and switches torch's optimizer keeps in every param group (amsgrad, maximize, foreach, fused, ...)
    with its defaults, or the values given (accepted when they change nothing here; see _options)."""
    defaults = torch_class([torch.zeros(1, requires_grad=True)]).defaults
    return {k: options.get(k, defaults[k]) for k in _TORCH_FLAGS if k in defaults}


class _AdamLike(DistributedOptimizer):
    state_keys = ADAM_STATE
    torch_class: type[torch.optim.Optimizer] | None = None  # the torch optimizer it replaces (LAMB: none)

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, torch_names: bool, options: dict[str, Any]):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        if self.torch_class is not None:
            defaults |= _torch_keys(self.torch_class, options)
        super().__init__(params, defaults, **_options(type(self).__name__, options, torch_names))

    def check_group(self, group: dict[str, Any]) -> None:
        betas = group["betas"]
        if isinstance(betas, list | tuple) and all(isinstance(b, torch.Tensor) and b.numel() == 1 for b in betas):
            betas = group["betas"] = tuple(float(b) for b in betas)  # torch accepts Tensor betas
        if len(betas) != 2 or not all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas):
            raise OptimizerError(f"{type(self).__name__}: betas must be two numbers in [0, 1), got {betas!r}")
        _refuse_flags(type(self).__name__, group)
        decoupled = self.torch_class is torch.optim.AdamW
        if self.torch_class is not None and group.get("decoupled_weight_decay", decoupled) != decoupled:
            other = "DistributedAdamW" if not decoupled else "DistributedAdam"
            raise OptimizerError(f"{type(self).__name__}: decoupled_weight_decay={not decoupled} is the weight decay "
                                 f"of {other}; use {other} (or a state dict saved by the optimizer it replaces)")

    def scalars(self, group: dict[str, Any], step: int, b: Bucket) -> dict[str, float]:
        b1, b2 = group["betas"]
        return dict(zip(ADAMW_SCALARS, (group["lr"], b1, b2, group["eps"], group["weight_decay"], step), strict=True))


class DistributedAdamW(_AdamLike):
    """torch.optim.AdamW (decoupled weight decay) with the gradient reduction of DDP, as one compiled program per
    bucket; sliced schedules keep exp_avg/exp_avg_sq (and fp32 masters) 1/p per rank.

    schedule: "auto" (the tuner's cached choice, else the schedule keeping the most state sliced, through shared
    memory when the ranks share a CPU host) or a schedule name of `cocoweave schedules examples/adamw.py:adamw`;
    reduction: "avg" (DDP's), "sum" or "adasum" (which runs unsplit); max_grad_norm: clip by the global norm of the
    reduced gradient, like torch.nn.utils.clip_grad_norm_ after DDP; process_group: the data-parallel group to
    reduce over (as DDP's); bucket_cap_mb: bucket size (DDP's 25); overlap: launch each bucket's reduction from
    backward; gather: "step" (the new parameters are in place when step() returns), "forward" (finished just
    before a module that uses them runs: opt in only when nothing else reads the parameters between step() and the
    next forward, or call opt.wait() first) or "auto" (step); master_weights: fp32 master
    weights and state for bf16/fp16 parameters (default False: torch's own semantics, state in their dtype);
    kernels: how the fused update runs ("auto", "compiled", "triton", "torch"); broadcast_buffers (default True, DDP's):
    module buffers (BatchNorm statistics) become rank 0's: before each forward of `module` (the model) when given,
    else at the end of each step, for the modules holding these parameters that ran forward before the first step.
    torch.optim's fused=, foreach=, capturable=False, differentiable=False and amsgrad=False are accepted.
    Clip with max_grad_norm= or opt.clip_grad_norm_(max_norm), never torch.nn.utils.clip_grad_norm_: gradients are
    reduced in step(), so between backward() and step() each rank holds its own (a change there is refused)."""

    workload = staticmethod(adamw)
    torch_class = torch.optim.AdamW

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, **options: Unpack[DistributedOptions]):
        super().__init__(params, lr, betas, eps, weight_decay, True, dict(options))


class DistributedAdam(DistributedAdamW):
    """torch.optim.Adam (L2 weight decay: weight_decay * w is added to the gradient) with DDP's gradient reduction;
    the same machinery and options as DistributedAdamW."""

    workload = staticmethod(adam_l2)
    torch_class = torch.optim.Adam

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, **options: Unpack[DistributedOptions]):
        super().__init__(params, lr, betas, eps, weight_decay, **options)


class DistributedLAMB(_AdamLike):
    """LAMB (You et al. 2020, Algorithm 2, phi = identity): the bias-corrected Adam direction plus weight decay,
    scaled per parameter tensor by |w| / |u|. Parameters of equal size share one [T, N] bucket (one per row), so
    the sliced schedules give each rank whole tensors and the trust ratios need no communication. The options are
    DistributedAdamW's (torch has no LAMB, so none of torch.optim's switches)."""

    workload = staticmethod(lamb)
    rows = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, **options: Unpack[DistributedOptions]):
        super().__init__(params, lr, betas, eps, weight_decay, False, dict(options))


class DistributedSGD(DistributedOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay) with DDP's gradient averaging in one
    compiled program per bucket; sliced schedules keep the momentum buffer sliced."""

    workload = staticmethod(sgd)
    state_keys = SGD_STATE
    has_step = False
    sparse_grads = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, **options: Unpack[DistributedOptions]):
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov, **_torch_keys(torch.optim.SGD, options)}
        super().__init__(params, defaults, **_options(type(self).__name__, dict(options)))

    def check_group(self, group: dict[str, Any]) -> None:
        _refuse_flags(type(self).__name__, group)
        if group.get("decoupled_weight_decay"):
            raise OptimizerError("DistributedSGD: decoupled_weight_decay=True is torch.optim.AdamW's; DistributedSGD "
                                 "adds weight_decay * w to the gradient as torch.optim.SGD does")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise OptimizerError("DistributedSGD: Nesterov momentum needs momentum > 0 and dampening 0")

    def scalars(self, group: dict[str, Any], step: int, b: Bucket) -> dict[str, float]:
        # as torch: the first step with momentum starts the buffer as the gradient itself (no dampening); without
        # momentum the buffer is neither used nor changed (momentum_on = 0)
        on = group["momentum"] != 0
        fresh = not on or (not b.started and not b.masked)
        return dict(zip(SGD_SCALARS, (group["lr"], group["momentum"], 0.0 if fresh else group["dampening"],
                                      group["weight_decay"], float(bool(group["nesterov"])), float(on)), strict=True))

    def stepped(self, group: dict[str, Any], b: Bucket) -> None:
        b.started = b.started or group["momentum"] != 0

    def has_state(self, b: Bucket, whole: Mapping[str, torch.Tensor], i: int) -> bool:
        if STARTED in whole and b.part(whole[STARTED], i).numel():
            return bool(b.part(whole[STARTED], i).reshape(-1)[0] > 0.5)
        return b.started
