"""What DDP does that the distributed optimizers do too: check at construction that every rank passes the same
parameters, start each bucket's gradient reduction from backward hooks (not under no_sync()), broadcast module
buffers from rank 0 (before each forward of `module=`, else at each step), and leave the all-gathers of new weights
in flight until a module that reads them runs forward (gather="forward")."""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import OptimizerError
from ..group_facts import group_timeout, world
from ..workloads.optimizer_contract import GRAD
from .buckets import Bucket
from .placements import local, set_grad
from .ranks import store_prefix


class DDPBehaviours:
    """DistributedOptimizer's DDP behaviours (a mixin of it)."""

    def _store_prefix(self) -> str:
        """This optimizer's keys in the job's store (its instance, its group's ranks)."""
        return store_prefix(self._instance, self.process_group)

    def _check_same_model(self) -> None:
        """As DDP at construction: every rank's parameters must agree in count, order, shape, dtype and
        requires_grad, else one sentence names the first difference (through the store: no collective runs yet)."""
        rank, size = world(self.process_group)
        if size == 1:
            return
        mine = [[[list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad] for p in g["params"]]
                for g in self.param_groups]
        store = dist.distributed_c10d._get_default_store()
        key = f"{self._store_prefix()}/model"
        store.set(f"{key}/{rank}", json.dumps(mine))
        limit = group_timeout(self.process_group)
        difference = None
        if rank != 0:
            try:
                store.wait([f"{key}/0"], datetime.timedelta(seconds=limit))
            except RuntimeError:
                raise OptimizerError(f"rank {rank}: {type(self).__name__} waited {limit:g} s (the process group's "
                                     "timeout) for rank 0 to make its optimizer; make it on every rank") from None
            difference = first_difference(json.loads(store.get(f"{key}/0")), mine, rank)
        store.add(f"{key}/differ", int(difference is not None))
        arrived, deadline = store.add(f"{key}/arrived", 1), time.monotonic() + limit
        while arrived < size:
            if time.monotonic() > deadline:
                raise OptimizerError(f"rank {rank}: {type(self).__name__} waited {limit:g} s (the process group's "
                                     f"timeout) for the other ranks to make their optimizers; {arrived} of {size} "
                                     "did. Make it on every rank")
            time.sleep(0.002)
            arrived = store.add(f"{key}/arrived", 0)
        differ = store.add(f"{key}/differ", 0)
        if difference is not None:
            raise OptimizerError(f"{type(self).__name__}: {difference}; every rank must pass the same parameters in "
                                 "the same order (as DDP checks)")
        if differ:
            raise OptimizerError(f"{type(self).__name__}: {differ} rank{'s' if differ > 1 else ''} passed other "
                                 "parameters than rank 0 (count, order, shape or dtype; the sentence on those ranks "
                                 "names the first difference); every rank must pass the same parameters")

    @staticmethod
    def _arriving(b: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        """A hook run before backward accumulates parameter i's gradient: a parameter without `.grad` (after
        zero_grad(set_to_none=True), as torch leaves it) gets its (zeroed) view, so autograd adds into the bucket in
        place instead of making a tensor of its own."""
        p, plain = b.params[i], b.plain[i]

        def hook(grad: torch.Tensor) -> None:  # runs per parameter per backward: no call in the common case
            if p.grad is None and grad.layout == torch.strided:
                view = b.grads[i]
                if not b.zeroed[i]:
                    view.zero_()
                b.zeroed[i] = b.stale[i] = False
                if plain:
                    p.grad = view
                else:
                    set_grad(p, view)
        return hook

    def _arrived(self, b: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        n = len(b.params)

        def hook(p: torch.Tensor) -> None:
            view, g = b.grads[i], p.grad
            if g is not view and ((g := local(g)).layout != view.layout or g.data_ptr() != view.data_ptr()):
                b.take(i)  # not the view: copied in
            b.version = b.grad._version  # any later in-place change of the gradients shows in this counter
            if not self._sync:  # accumulating under no_sync: the reduction waits for the backward outside it
                return
            if not b.arrived[i]:
                b.arrived[i] = True
                b.count += 1
            if self.overlap and b.count == n:
                b.launched = b.exe.launch({GRAD: b.grad}) or b.launched
                b.reset_arrivals()  # the next backward (accumulation) launches again
        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without launching their reduction (DDP's no_sync): use it for every micro-batch but
        the last. (Launching anyway is still correct, only slower: a later launch replaces an earlier one.)"""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def wait(self) -> None:
        """Complete the all-gathers of new parameters a step left in flight (gather="forward")."""
        while self._deferred:
            self._deferred.pop(0).exe.wait()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _defer(self, b: Bucket) -> bool:
        """Leave b's all-gather in flight after step() only when asked (gather="forward"): until it completes, a read
        of the parameters other than a module's forward (a state_dict, an EMA, a norm) sees half-written weights."""
        return self.gather == "forward"

    def _broadcast_buffers(self, module: torch.nn.Module, args: Any) -> None:
        """Module buffers (BatchNorm's running statistics) become rank 0's before each forward, as DDP does."""
        if module.training:
            self._broadcast(list(module.buffers()))

    def _find_buffers(self, module: torch.nn.Module, args: Any) -> None:
        """Without `module=`: remember each module the forwards before the first step run that holds one of the
        optimizer's parameters and buffers of its own (a BatchNorm layer); step() broadcasts their buffers."""
        if module._buffers and any(p is not None and id(p) in self._owner for p in module._parameters.values()):
            self._buffer_modules.setdefault(id(module), module)

    def _sync_buffers(self) -> None:
        """At the end of a step: the found modules' buffers become rank 0's (the forwards of the first step found
        them: every rank ran the same modules)."""
        if self._finder is not None:
            self._finder.remove()
            self._finder = None
        if self._buffer_modules:
            self._broadcast([b for m in self._buffer_modules.values() for b in m.buffers(recurse=False)])

    def _broadcast(self, buffers: list[torch.Tensor]) -> None:
        """Broadcast floating-point and int64 `buffers` from rank 0 of the group (one broadcast per dtype)."""
        buffers = [b for b in buffers if b.is_floating_point() or b.dtype == torch.int64]
        if not buffers:
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        with torch.no_grad():
            for dtype in sorted({b.dtype for b in buffers}, key=str):  # the same order on every rank
                same = [b for b in buffers if b.dtype == dtype]
                flat = torch.cat([b.reshape(-1) for b in same])
                dist.broadcast(flat, src, group=self.process_group)
                for b, part in zip(same, flat.split([b.numel() for b in same]), strict=True):
                    b.copy_(part.view_as(b))

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A module is about to run: the all-gathers of its parameters' buckets complete first."""
        for p in module._parameters.values():
            b = self._owner.get(id(p)) if p is not None else None
            if b is not None and b in self._deferred:
                self._deferred.remove(b)
                b.exe.wait()
        if not self._deferred:
            self.wait()


def first_difference(theirs: list, mine: list, rank: int) -> str | None:
    """The first difference between rank 0's parameters (`theirs`: per group, [shape, dtype, requires_grad] per
    parameter) and this rank's, in words; None when they agree."""
    if len(theirs) != len(mine):
        return f"rank {rank} has {len(mine)} parameter groups, rank 0 {len(theirs)}"
    for gi, (a, b) in enumerate(zip(theirs, mine, strict=True)):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                what = ("shape" if x[0] != y[0] else "dtype" if x[1] != y[1] else "requires_grad")
                return (f"parameter {i} of group {gi} differs in {what}: {y[0]} {y[1]} requires_grad={y[2]} on rank "
                        f"{rank}, {x[0]} {x[1]} requires_grad={x[2]} on rank 0")
        if len(a) != len(b):
            return f"group {gi} has {len(b)} parameters on rank {rank}, {len(a)} on rank 0"
    return None
