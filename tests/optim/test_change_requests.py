"""Change requests of issue #49, each made in this one file to show what it takes.

A factored-state optimizer: Adafactor (Shazeer & Stern 2018, as torch.optim.Adafactor computes it), written here as
a DistributedOptimizer subclass and its program on cocoweave's optimizer machinery, with no edit elsewhere: a
parameter of shape [..., R, C] keeps its second moment as a row statistic [..., R, 1] and a column one [..., 1, C]
(a vector parameter keeps it whole). Its parameters share "shaped" buckets [T, *shape] (one parameter per row, in
its own shape), so the program reduces each parameter along its own dims; `state_shape` / `state_part` say where
torch's state of each parameter is in the bucket's. Checked equal to torch.optim.Adafactor fed the ranks' average
gradient (what DDP hands it), at 1 and 2 Gloo ranks, with a parameter skipped on some steps (torch skips one
without a gradient), and through state dicts both ways.

A new tensor-parallel layer: a vocab-parallel LM head, in this file alone, checked against the one-process layer."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Unpack

import pytest
import torch

from cocoweave.errors import OptimizerError
from cocoweave.ir import Program
from cocoweave.ir.ops import max as dsl_max
from cocoweave.ir.ops import maximum, minimum, norm, rsqrt, where
from cocoweave.ir.ops import sum as dsl_sum
from cocoweave.ir.types import Dim
from cocoweave.nn.functional import copy_to_parallel, gather_from_parallel, group_rank, group_size, part
from cocoweave.optim import DistributedOptimizer, DistributedOptions
from cocoweave.optim.buckets import Bucket
from cocoweave.workloads.optimizers import Parts

# -- Adafactor: its contract, program and optimizer ------------------------------------------------------------

ROW_VAR, COL_VAR, VARIANCE = "row_var", "col_var", "variance"  # program state name (torch's key is the same)
ADAFACTOR_SCALARS = ("lr", "one_minus_beta2", "rho", "eps1", "eps2", "d", "weight_decay")
MASKED_SCALARS = ("lr", "beta2_decay", "eps1", "eps2", "d", "weight_decay")  # the step's terms are per element


def adafactor(shape: tuple[Dim, ...] = (4, 8, 16), grad: str = "local", reduction: str = "avg",
              param_dtype: str = "float32", *, master_weights: bool = True, clip: bool = False,
              masked: bool = False) -> Program:
    """torch.optim.Adafactor on a [T, *S] bucket (parameter t is row t, of shape S): the second moment of a
    parameter of 2 or more dims as row and column means of g^2 (lerped with weight one_minus_beta2 = t^beta2_decay),
    their outer product over the mean of the row one as the estimate; the update g / sqrt(estimate) clipped to an
    RMS of d, scaled by max(eps2, RMS(w)) * rho, rho = min(lr, 1 / sqrt(t)); decoupled weight decay
    w *= 1 - lr * wd. A masked program counts t per element and leaves a parameter without a gradient as it is."""
    p = Program("adafactor")
    x = Parts(p, tuple(shape), grad, reduction, param_dtype, master_weights, clip, masked)
    if masked:
        lr, beta2_decay, eps1, eps2, d, wd = p.scalars(" ".join(MASKED_SCALARS))
        t = x.steps(None)
        one_minus_beta2, rho = t**beta2_decay, minimum(rsqrt(t), lr)
        on = where(x.active, 1.0, 0.0)
    else:
        lr, one_minus_beta2, rho, eps1, eps2, d, wd = p.scalars(" ".join(ADAFACTOR_SCALARS))
    own = tuple(range(1, len(shape)))  # each parameter's own dims
    numel = math.prod(shape[1:])
    alpha = maximum(norm(x.w, own, keepdim=True) / numel**0.5, eps2) * rho  # before the weight decay, as torch
    if len(shape) > 2:
        rows, cols = shape[-2], shape[-1]
        row, row_f = x.state(ROW_VAR, init="positive", shape=(*shape[:-1], 1))
        col, col_f = x.state(COL_VAR, init="positive", shape=(*shape[:-2], 1, cols))
        row_n, col_n = norm(x.g, -1, keepdim=True), norm(x.g, -2, keepdim=True)
        row_w = one_minus_beta2 if not masked else dsl_max(one_minus_beta2, -1, keepdim=True)  # one per row
        col_w = one_minus_beta2 if not masked else dsl_max(one_minus_beta2, -2, keepdim=True)
        row_new = row_f + row_w * (row_n * row_n / cols - row_f)
        col_new = col_f + col_w * (col_n * col_n / rows - col_f)
        if masked:  # a parameter is active or not as a whole: its row of the statistics with it
            row_new = where(dsl_max(on, -1, keepdim=True) > 0.5, row_new, row_f)
            col_new = where(dsl_max(on, -2, keepdim=True) > 0.5, col_new, col_f)
        row_f, col_f = x.write(row, row_new), x.write(col, col_new)
        estimate = row_f * col_f / maximum(dsl_sum(row_f, -2, keepdim=True) / rows, eps1)
    else:
        var, var_f = x.state(VARIANCE, init="positive")
        estimate = x.write(var, x.keep(var_f + one_minus_beta2 * (x.g * x.g - var_f), var_f))
    update = rsqrt(maximum(estimate, eps1 * eps1)) * x.g
    denom = maximum(norm(update, own, keepdim=True) / (numel**0.5 * d), 1.0)
    x.write_weights(x.w * (1 - lr * wd) - (alpha / denom) * update)
    return p


class DistributedAdafactor(DistributedOptimizer):
    """torch.optim.Adafactor with DDP's gradient reduction, one compiled program per bucket of equal-shaped
    parameters."""

    workload = staticmethod(adafactor)
    state_keys = {ROW_VAR: "row_var", COL_VAR: "col_var", VARIANCE: "variance"}
    shaped = True
    numeric_hyperparameters = ("lr", "d", "weight_decay")  # eps is torch's pair (eps1 or None, eps2)

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0,
                 foreach: bool | None = None, maximize: bool = False, **options: Unpack[DistributedOptions]):
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": tuple(eps), "d": d, "weight_decay": weight_decay,
                    "foreach": foreach, "maximize": maximize}
        super().__init__(params, defaults, **options)

    def check_group(self, group: dict[str, Any]) -> None:
        if group.get("maximize"):
            raise OptimizerError("DistributedAdafactor: maximize=True is not supported; minimise the negated loss")
        if group["beta2_decay"] > 0 or group["d"] < 1:
            raise OptimizerError("DistributedAdafactor: beta2_decay must be <= 0 and d >= 1")

    def scalars(self, group: dict[str, Any], step: int, b: Bucket) -> dict[str, float]:
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(b.dtype).eps if eps1 is None else eps1
        if b.masked:  # per-element step counts: the program raises them to beta2_decay itself
            values = (group["lr"], group["beta2_decay"], eps1, eps2, group["d"], group["weight_decay"])
            return dict(zip(MASKED_SCALARS, values, strict=True))
        values = (group["lr"], step ** group["beta2_decay"], min(group["lr"], 1 / step**0.5), eps1, eps2,
                  group["d"], group["weight_decay"])
        return dict(zip(ADAFACTOR_SCALARS, values, strict=True))

    def state_shape(self, b: Bucket, name: str) -> tuple[int, ...]:
        if name == ROW_VAR:
            return (*b.shape[:-1], 1)
        if name == COL_VAR:
            return (*b.shape[:-2], 1, b.shape[-1])
        return b.shape

    def state_part(self, b: Bucket, name: str, t: torch.Tensor, i: int) -> torch.Tensor:
        return t[i] if name in (ROW_VAR, COL_VAR) else b.part(t, i)


# -- equal to torch.optim.Adafactor ------------------------------------------------------------------------------

SHAPES = [(6, 4), (6,), (3, 6), (3,), (6, 4), (2, 3, 4)]  # two [6, 4] share a bucket; a 3-d one factors its last two
HYPER = {"lr": 0.05, "weight_decay": 0.1, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0}
STEPS = 5
SKIP = {2: 4, 3: 1}  # step -> the parameter no rank has a gradient for (torch skips it; its bucket's program masks)


def _grad(step: int, k: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * k + rank)
    return torch.randn(SHAPES[k], generator=gen)


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _step_both(step: int, rank: int, world_size: int, opt: DistributedOptimizer, ours: list[torch.Tensor],
               ref: torch.optim.Optimizer, theirs: list[torch.Tensor]) -> float:
    """One step of ours (this rank's gradients, through backward) and of torch's (fed their average), but for
    parameter SKIP[step]: the worst difference of the parameters after it."""
    opt.zero_grad()
    ref.zero_grad()
    given = [k for k in range(len(SHAPES)) if SKIP.get(step) != k]
    sum((ours[k] * _grad(step, k, rank)).sum() for k in given).backward()
    for k in given:
        theirs[k].grad = sum(_grad(step, k, r) for r in range(world_size)) / world_size
    opt.step()
    ref.step()
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(ours, theirs, strict=True))


def _train(rank: int, world_size: int) -> dict[str, Any]:
    """STEPS steps of DistributedAdafactor and of torch.optim.Adafactor: the worst difference of the parameters
    after each step, of opt.state[p] and state_dict() at the end, and after one more step from torch's state dict."""
    ours, theirs = _params(), _params()
    opt = DistributedAdafactor(ours, **HYPER)
    ref = torch.optim.Adafactor(theirs, foreach=False, **HYPER)
    worst = [_step_both(step, rank, world_size, opt, ours, ref, theirs) for step in range(STEPS)]
    state = max(float((opt.state[p][key] - ref.state[q][key]).abs().max() / ref.state[q][key].abs().max())
                for p, q in zip(ours, theirs, strict=True) for key in ref.state[q] if key != "step")
    keys = [sorted(opt.state[p]) == sorted(ref.state[q]) for p, q in zip(ours, theirs, strict=True)]
    saved, theirs_saved = opt.state_dict(), ref.state_dict()
    saved_off = max(float((saved["state"][i][key] - v).abs().max()) for i, e in theirs_saved["state"].items()
                    for key, v in e.items())
    # torch's state dict loaded into a fresh optimizer over copies of the parameters: one more step, equal again
    again = [torch.nn.Parameter(q.detach().clone()) for q in theirs]
    loaded = DistributedAdafactor(again, **HYPER)
    loaded.load_state_dict(theirs_saved)
    after_load = _step_both(STEPS, rank, world_size, loaded, again, ref, theirs)
    return {"worst": worst, "state": state, "keys": keys, "saved": saved_off, "after load": after_load,
            "moved": float((theirs[0].detach() - _params()[0].detach()).abs().max()), "schedules": opt.schedules}


@pytest.mark.parametrize("world_size", [1, 2])
def test_adafactor_written_in_one_file_trains_as_torch_adafactor(local_world, world_size: int) -> None:
    for rank, res in enumerate(local_world(world_size).run(_train)):
        where = f"rank {rank} of {world_size} ({', '.join(res['schedules'])})"
        assert res["moved"] > 0.05, f"{where}: the reference barely trained ({res['moved']})"
        assert max(res["worst"]) <= 5e-6, f"{where}: parameters off by {res['worst']} (per step)"
        assert all(res["keys"]), f"{where}: opt.state[p] has other keys than torch's"
        assert res["state"] <= 5e-6, f"{where}: row_var / col_var / variance off by {res['state']} (relative)"
        assert res["saved"] <= 5e-6, f"{where}: state_dict() off torch's by {res['saved']}"
        assert res["after load"] <= 5e-6, f"{where}: a step after loading torch's state dict is off by " \
                                          f"{res['after load']}"


# -- a new tensor-parallel layer: a vocab-parallel LM head, in this file alone ----------------------------------
# (VocabParallelEmbedding exists already, in nn/vocab.py.) The head's weight [V, d] is split by vocabulary rows over
# the tensor-parallel group, built from nn/functional.py's Megatron primitives: the input copied into the parallel
# region (its gradient summed over the group), each rank's logits of its vocabulary part, all-gathered along the
# vocabulary. Nothing outside this file changes.


class ParallelLMHead(torch.nn.Module):
    """logits = x Wᵀ (no bias) with W's vocabulary rows split over `group`: rank r holds part r (torch.tensor_split
    sizes); `gather_output` returns the whole logits on every rank, else this rank's vocabulary part of them."""

    def __init__(self, weight: torch.Tensor, group: Any = None, gather_output: bool = True):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.weight = torch.nn.Parameter(part(weight.detach(), 0, group_size(group), group_rank(group)).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(copy_to_parallel(x, self.group), self.weight)
        return gather_from_parallel(logits, -1, self.group) if self.gather_output else logits


def _head(rank: int, world_size: int) -> dict[str, float]:
    """The head at this tensor-parallel size against the one-process nn.Linear(d, V, bias=False) with the same
    weight: the logits, the input's gradient and this rank's part of the weight's gradient."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(10, 6, generator=gen)  # V = 10, d = 6
    x = torch.randn(4, 6, generator=gen)
    dy = torch.randn(4, 10, generator=gen)
    ref = torch.nn.Linear(6, 10, bias=False)
    with torch.no_grad():
        ref.weight.copy_(full)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    (yr * dy).sum().backward()
    head = ParallelLMHead(full)
    yo = head(xo)
    (yo * dy).sum().backward()
    return {"forward": float((yo - yr).abs().max()), "input grad": float((xo.grad - xr.grad).abs().max()),
            "weight grad": float((head.weight.grad - part(ref.weight.grad, 0, world_size, rank)).abs().max()),
            "local rows": head.weight.shape[0]}


def test_a_vocab_parallel_lm_head_written_in_one_file_is_the_whole_layer_at_tp_2(local_world) -> None:
    for rank, res in enumerate(local_world(2).run(_head)):
        assert res["local rows"] == 5, f"rank {rank}: holds {res['local rows']} of the 10 vocabulary rows"
        for what in ("forward", "input grad", "weight grad"):
            assert res[what] <= 1e-5, f"rank {rank}: {what} off the one-process layer by {res[what]}"
