"""DistributedAdamW, DistributedLAMB and DistributedSGD: torch.optim.Optimizer subclasses that replace
DDP + optimizer. Call loss.backward() on the plain model, then step(): each bucket's compiled
program averages the gradients and updates weights and state with its tuned schedule."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import OptimizerError
from ..workloads.optimizers import adamw, lamb, sgd
from .base import DistributedOptimizer


class _AdamLike(DistributedOptimizer):
    state_keys = {"m": "exp_avg", "v": "exp_avg_sq"}

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, schedule: str, reduction: str, max_grad_norm: float | None, process_group: Any):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, schedule, reduction, max_grad_norm, process_group)

    def check_group(self, group: dict[str, Any]) -> None:
        betas = group["betas"]
        if len(betas) != 2 or not all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas):
            raise OptimizerError(f"{type(self).__name__}: betas must be two numbers in [0, 1), got {betas!r}")

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        b1, b2 = group["betas"]
        return {"lr": group["lr"], "beta1": b1, "beta2": b2, "eps": group["eps"],
                "weight_decay": group["weight_decay"], "step": step}


class DistributedAdamW(_AdamLike):
    """torch.optim.AdamW (decoupled weight decay) with the gradient all-reduce of DDP, as one tuned
    program per bucket; sliced schedules keep exp_avg/exp_avg_sq (and fp32 masters) sliced.

    schedule: "auto" (the tuner's cached choice, else the most-sliced schedule) or a schedule name of
    `cocoweave schedules examples/adamw.py:adamw`; reduction: "avg" (DDP's), "sum" or "adasum" (which
    runs unsplit); max_grad_norm: clip by the global norm of the reduced gradient, like
    torch.nn.utils.clip_grad_norm_ after DDP; process_group: the data-parallel group to reduce over (as
    DDP's), e.g. one of cocoweave.nn.parallel_groups' in a data x tensor parallel grid; None: the world."""

    workload = staticmethod(adamw)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, schedule: str = "auto", reduction: str = "avg",
                 max_grad_norm: float | None = None, process_group: Any = None):
        super().__init__(params, lr, betas, eps, weight_decay, schedule, reduction, max_grad_norm, process_group)


class DistributedLAMB(_AdamLike):
    """LAMB (You et al. 2020, Algorithm 2, phi = identity): the bias-corrected Adam direction plus
    weight decay, scaled per parameter tensor by |w| / |u|. Parameters of equal size share one
    [N, T] program whose sliced schedules all-reduce only the T partial norms."""

    workload = staticmethod(lamb)
    columns = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, schedule: str = "auto", reduction: str = "avg",
                 max_grad_norm: float | None = None, process_group: Any = None):
        super().__init__(params, lr, betas, eps, weight_decay, schedule, reduction, max_grad_norm, process_group)


class DistributedSGD(DistributedOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay) with DDP's gradient averaging
    in one tuned program per bucket; sliced schedules keep the momentum buffer sliced."""

    workload = staticmethod(sgd)
    state_keys = {"buf": "momentum_buffer"}
    has_step = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, schedule: str = "auto",
                 reduction: str = "avg", max_grad_norm: float | None = None, process_group: Any = None):
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov}
        super().__init__(params, defaults, schedule, reduction, max_grad_norm, process_group)

    def check_group(self, group: dict[str, Any]) -> None:
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise OptimizerError("DistributedSGD: Nesterov momentum needs momentum > 0 and dampening 0")

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        # torch starts the buffer as the gradient itself (no dampening) and ignores it without momentum
        first = step == 1 or group["momentum"] == 0
        return {"lr": group["lr"], "momentum": group["momentum"], "dampening": 0.0 if first else group["dampening"],
                "weight_decay": group["weight_decay"], "nesterov": float(bool(group["nesterov"]))}
