"""The step: each bucket's program driven stage by stage (a generator paused before each stage, so clipping can
work between them), its inputs for this step gathered, and the wall time of its phases recorded."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import OptimizerError
from ..workloads.optimizer_contract import ACTIVE, GRAD
from .buckets import Bucket

PHASES = {"reduce_scatter": "reduce", "all_reduce": "reduce", "all_gather": "gather"}


class Stepping:
    """DistributedOptimizer's step() (a mixin of it)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients and update the parameters with each bucket's compiled program."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets = self._ensure_buckets()
        self.wait()
        start = time.perf_counter()
        paused, self._paused = self._paused, None
        runs = paused if paused is not None else self._start(buckets)
        if self.max_grad_norm is not None and paused is None:  # clip_grad_norm_ clipped the paused ones
            self._clip(runs)
        phases: dict[str, float] = {}
        for b, exe, steps in runs:
            finish(steps, exe, phases)
            if b.in_slot:  # this rank's part of the gradient buffer now holds the reduced gradient
                b.stale = [True] * len(b.params)
            b.step += 1
            self.stepped(self.param_groups[b.group], b)
            b.launched = False
            if self._defer(b):
                self._deferred.append(b)
        if self._deferred and self._forward_hook is None:
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        for b in buckets:
            b.reset_arrivals()
            b.zeroed = [False] * len(b.params)  # the reduction may have worked inside the gradient buffer
            b.version = None
        self._publish_steps()
        self._sync_buffers()
        for b in buckets:
            if id(b) in self._gathered:  # opt.state[p] holds last step's gathered state: gather anew when read
                self._publish_views(b)
        self.last_step_ms = {**phases, "step": (time.perf_counter() - start) * 1e3}
        return loss

    def _start(self, buckets: list[Bucket]) -> list[tuple[Bucket, Any, Iterator]]:
        """Each bucket's step, not yet run (a generator paused before its first stage)."""
        self._check_untouched(buckets)
        runs = []
        for b, act in zip(buckets, self._active(buckets), strict=True):
            if act is not None and not act.any():
                b.exe.cancel()  # no rank has a gradient for any of its parameters: torch leaves them as they are
                continue
            inputs = self._inputs(b, act)  # first: it may switch the bucket to its masked program
            runs.append((b, b.exe, b.exe.steps(inputs, defer_gathers=self._defer(b))))
        return runs

    def _check_untouched(self, buckets: list[Bucket]) -> None:
        """Gradients are reduced in step(), after backward: an in-place change of them in between (torch's
        clip_grad_norm_, a GradScaler's unscale_, a DDP wrapper writing its reduced gradients back) would act on
        each rank's local gradient, or be lost under a reduction already launched. Refuse it with a sentence."""
        for b in buckets:
            if b.version is not None and b.grad._version != b.version:
                b.version = None
                raise OptimizerError(
                    f"{type(self).__name__}: the gradients changed between backward() and step(); cocoweave reduces "
                    "them in step(), so a change before it sees only this rank's local gradient. Clip with "
                    "max_grad_norm= or opt.clip_grad_norm_(max_norm) (not torch.nn.utils.clip_grad_norm_), scale the "
                    "loss instead of the gradients, and do not wrap the model in DistributedDataParallel")

    def _inputs(self, b: Bucket, active: torch.Tensor | None) -> dict[str, Any]:
        """The bucket program's inputs for this step (switching it to its masked program the first time a parameter
        goes without a gradient)."""
        group = self.param_groups[b.group]
        if active is not None and not b.masked:  # for good: per-element step counts start at the bucket's count
            self._rebuild(b, masked=True)
        inputs = {GRAD: b.grad, **b.state, **self.scalars(group, b.step + 1, b), **self._clip_scalar()}
        if b.masked:
            inputs[ACTIVE] = active if active is not None else torch.ones(b.shape, dtype=torch.bool,
                                                                             device=b.device)
        return inputs


def finish(steps: Iterator, exe: Any, phases: dict[str, float]) -> Any:
    """Run a paused step to its end, adding the wall time of its stages to `phases` ("reduce": the gradient's
    reduce-scatter or all-reduce, "update": computation, "gather": the all-gathers of new weights)."""
    t, phase = time.perf_counter(), None
    try:
        while True:
            index, _ = next(steps)
            now = time.perf_counter()
            if phase is not None:
                phases[phase] = phases.get(phase, 0.0) + (now - t) * 1e3
            op = exe.stage_op(index)
            phase, t = PHASES.get(op, "gather" if op else "update"), now
    except StopIteration as done:
        if phase is not None:
            phases[phase] = phases.get(phase, 0.0) + (time.perf_counter() - t) * 1e3
        return done.value
