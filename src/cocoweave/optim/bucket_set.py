"""The optimizer's bucket set: parameter groups checked, trainable parameters put into buckets (by the bucket
policy), each bucket's program built and compiled, its tensors placed where the program's collectives need no copies,
recompiled (masked, clipped) with its state carried over, and its gradients zeroed."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..compiler import compile as compile_schedule
from ..errors import OptimizerError, ParallelConfigError
from ..group_facts import shared_memory, world
from ..ir.graph import Program
from ..ir.types import canonical_dtype
from ..sharding import local_data
from ..workloads.optimizer_contract import GIVEN, GRAD, WEIGHTS, model_weights
from .bucket_policy import BucketPolicy
from .buckets import Bucket, buckets_of
from .placements import check_placement, set_grad
from .schedule_choice import norm_reduction, resolve_schedule

log = logging.getLogger("cocoweave.optim")

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the optimizer programs take


class BucketSet:
    """DistributedOptimizer's buckets (a mixin of it): `_buckets`, and `_owner` (a parameter's id -> its bucket).

    What an optimizer family may set (beside base.py's `rows`): `shaped` (parameters of one shape share a [T, *shape]
    bucket, one per row, and the program is built with `shape=`: a factored optimizer reduces each parameter along
    its own dims) and `numeric_hyperparameters` (the group keys checked to be non-negative numbers)."""

    shaped = False
    numeric_hyperparameters: tuple[str, ...] = ("lr", "weight_decay", "eps", "momentum", "dampening")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"] if isinstance(param_group, dict) else None
        if isinstance(params, list | tuple) and len(params) != len(set(params)):
            # torch warns and steps such a parameter twice (pytorch#40967); a bucket holds a parameter once
            warnings.warn("optimizer contains a parameter group with duplicate parameters; in future, this will "
                          "cause an error; see github.com/pytorch/pytorch/issues/40967 for more information "
                          "(cocoweave keeps each parameter once: it is stepped once, where torch steps it twice)",
                          stacklevel=3)
            param_group = {**param_group, "params": list(dict.fromkeys(params))}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_hyperparameters(group)
        except OptimizerError:
            self.param_groups.pop()
            raise
        for p in group["params"]:
            if p.dtype not in PARAM_DTYPES:
                self.param_groups.pop()
                raise OptimizerError(f"{type(self).__name__}: parameters must be float32, bfloat16 or float16 (the "
                                     f"fused programs' types; float64 and complex are not supported), got {p.dtype} "
                                     f"of shape {list(p.shape)}")
            try:
                check_placement(type(self).__name__, lambda p=p: self._param_name(p), p, self.process_group,
                                self.rows or self.shaped)
            except ParallelConfigError:
                self.param_groups.pop()
                raise
            if p.device != group["params"][0].device:
                raise OptimizerError(f"{type(self).__name__}: the parameters of one group are on several devices")

    def _param_name(self, p: torch.Tensor) -> str:
        """How a sentence names parameter p: by its name in `module=`'s named_parameters, else by its index over
        every group."""
        module = self._options.get("module")
        for name, q in module.named_parameters() if module is not None else ():
            if q is p:
                return f"parameter {name!r}"
        return f"parameter {[q is p for g in self.param_groups for q in g['params']].index(True)}"

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Raise OptimizerError for a hyperparameter of `group` the optimizer cannot use; one-element tensors
        (torch accepts a tensor lr or betas) become their numbers."""
        for name in ("lr",) + tuple(k for k in group if k in self.numeric_hyperparameters and k != "lr"):
            value = group[name]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = group[name] = float(value)  # torch accepts a tensor lr: its value is what counts
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise OptimizerError(f"{type(self).__name__}: {name} must be a non-negative number, got {value!r}")
        self.check_group(group)

    def _ensure_buckets(self) -> list[Bucket]:
        """Buckets (compiled, with views and hooks) for every trainable parameter not yet bucketed: a new group's,
        or one frozen (requires_grad=False) when the optimizer was made and unfrozen since, which torch trains from a
        fresh state. (A collective when there are some: every rank unfreezes alike.)"""
        groups, seen = self.param_groups, self._groups_seen
        if len(seen) != len(groups) or any(g["params"] is not ps or len(ps) != n
                                           for g, (ps, n) in zip(groups, seen, strict=True)):
            # a group added or its parameter list replaced: look at every parameter once (not at every step)
            self._groups_seen = [(g["params"], len(g["params"])) for g in groups]
            self._unbucketed = [(gi, p) for gi, g in enumerate(groups) for p in g["params"] if id(p) not in self._owner]
        elif not any(p.requires_grad for _, p in self._unbucketed):
            return self._buckets
        built = False
        for gi in range(len(groups)):
            new = [p for g, p in self._unbucketed if g == gi and p.requires_grad]
            if new:
                policy = BucketPolicy.of(self.bucket_cap_mb, self.reduction, self.rows, world(self.process_group)[1],
                                         self.shaped)
                for b in buckets_of(policy, gi, new):
                    self._build(b)
                    self._buckets.append(b)
                    built = True
        if built:
            self._unbucketed = [(gi, p) for gi, p in self._unbucketed if id(p) not in self._owner]
            self._settle()
        return self._buckets

    def _settle(self) -> None:
        """Wait until every rank has put its parameters into their buckets. On one host the ranks share the
        parameters' memory: without this, a rank that goes on (say, to load a checkpoint into the model) could
        have its writes overwritten by a slower rank still copying the parameters in."""
        if world(self.process_group)[1] > 1:
            dist.barrier(group=self.process_group)

    def _program(self, b: Bucket, masked: bool = False) -> Program:
        sizes = {"shape": b.shape} if self.shaped else \
            {"N": b.shape[-1]} | ({"T": b.shape[0], "rows": True} if self.rows else {})
        return self.workload(**sizes, grad="local", reduction=self.reduction, param_dtype=canonical_dtype(b.dtype),
                             master_weights=self.master_weights, clip=self.max_grad_norm is not None, masked=masked)

    @staticmethod
    def _whole(program: Program) -> set[str]:
        """The program inputs the model reads: never sliced."""
        return {model_weights(program.inputs)}

    def _compile(self, b: Bucket, program: Program) -> None:
        """Give bucket b the schedule of `program` this optimizer runs, its executable, and (clipping) the name of
        the squared-norm all-reduce the step pauses before."""
        rank, size = world(self.process_group)
        shared = shared_memory(self.process_group, b.device) is not None
        clipped = self.max_grad_norm is not None
        whole = self._whole(program)
        b.schedule = resolve_schedule(program, self.schedule, size, whole, b.device.type, shared, clipped)
        b.exe = compile_schedule(b.schedule, "torch", device=b.device, rank=rank, world_size=size,
                                 group=self.process_group, kernels=self.kernels)
        b.norm = norm_reduction(b.schedule) if clipped else None

    def _build(self, b: Bucket) -> None:
        rank, size = world(self.process_group)
        self._compile(b, self._program(b))
        if size > 1:  # every rank starts from rank 0's parameters, as DDP does
            src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
            with torch.no_grad():
                for p in b.params:
                    dist.broadcast(local_data(p), src, group=self.process_group)
        self._place(b)
        self._reset_state(b, {})
        for i, p in enumerate(b.params):
            self._owner[id(p)] = b
            p.register_hook(self._arriving(b, i))
            p.register_post_accumulate_grad_hook(self._arrived(b, i))
        log.info("%s: bucket of %d parameters (%d elements, %s) runs %s", type(self).__name__, len(b.params), b.numel,
                 b.dtype, b.schedule.name)

    @staticmethod
    def _place(b: Bucket, keep_grad: bool = False) -> None:
        """Put bucket b's gradients and parameters where its program's collectives need no copies (on one host: the
        slot its gradient reduction reads, the tensor its all-gather fills, shared by the host's ranks; else buffers
        of its own)."""
        grad = b.exe.shared_input(GRAD)
        b.attach(grad, b.exe.shared_input(model_weights(b.exe.tensor_inputs())), keep_grad=keep_grad)
        b.in_slot = grad is not None
        if not keep_grad:  # kept gradients keep their standing (a step without zero_grad() is still refused)
            b.stale = [False] * len(b.params)

    def _rebuild(self, b: Bucket, masked: bool) -> None:
        """Recompile bucket b's program (masked, or clipping now on), its state carried over; its parameters and
        gradients (values kept) move into the new program's slots, as `_build` puts them there."""
        whole = self._gather_whole(b)
        b.exe.cancel()
        self._compile(b, self._program(b, masked=masked))
        b.masked = masked
        self._place(b, keep_grad=True)
        self._reset_state(b, whole)

    def _reset_state(self, b: Bucket, state: Mapping[str, torch.Tensor], master: torch.Tensor | None = None) -> None:
        """Give bucket b this (whole) state, initial values for names not given. The parameters themselves are the
        program's weights (updated in place); fp32 master weights start from them. Sliced state goes to the
        executable, which keeps only its slice (made already sliced when it starts from a constant: no whole copy)."""
        inputs, sliced = b.exe.tensor_inputs(), set(b.schedule.sliced_state)
        model_reads = model_weights(inputs)
        b.state = {}
        for n, dtype in inputs.items():
            if n in GIVEN:
                continue
            if n == model_reads:
                b.state[n] = b.data
                continue
            t = state.get(n, master if n == WEIGHTS and master is not None else b.data if n == WEIGHTS else None)
            if n in sliced:  # whole: its slice is copied out; the initial value: made as the slice
                b.exe.adopt(n, t.detach().to(dtype).reshape(self.state_shape(b, n)) if t is not None else
                            torch.full(b.exe.local_shape(n), self.initial_state(b, n), dtype=dtype,
                                       device=b.device))
            elif t is not None:
                b.state[n] = t.detach().to(dtype).reshape(self.state_shape(b, n)).clone()
            else:
                b.state[n] = torch.full(self.state_shape(b, n), self.initial_state(b, n), dtype=dtype, device=b.device)
        self._publish_views(b)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers. As torch: with set_to_none every `.grad` becomes None (backward then
        accumulates into the bucket again: a hook gives each parameter its view back), and a parameter backward does
        not reach before the next step is skipped, not updated with zeros; without it the `.grad` views are zeros."""
        if self._paused is not None:
            raise OptimizerError("clip_grad_norm_ reduced this step's gradients: call step() before zero_grad()")
        buckets = self._ensure_buckets()
        for _, p in self._unbucketed:  # parameters the buckets do not hold (frozen ones), as torch does
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad = p.grad.detach().zero_()
        for b in buckets:  # (a user's replaced weights or gradients are taken back by the step's restore_views)
            b.version = None
            if b.launched:
                b.exe.cancel()
                b.launched = False
            b.grad.zero_()
            n = len(b.params)
            b.stale, b.zeroed = [False] * n, [True] * n
            b.reset_arrivals()
            for p, plain, view in zip(b.params, b.plain, b.grads, strict=True):  # as torch: None stays None
                g = None if set_to_none or p.grad is None else view
                if plain:
                    p.grad = g  # a plain parameter's gradient is the view itself: no call per parameter
                else:
                    set_grad(p, g)

    @property
    def schedules(self) -> list[str]:
        """The schedule each bucket runs (chosen by `schedule`, e.g. "auto": the tuned or most-sliced one)."""
        return [b.schedule.name for b in self._ensure_buckets()]
