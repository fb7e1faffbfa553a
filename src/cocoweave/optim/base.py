"""The machinery shared by the distributed optimizers: buckets whose parameters and gradients are views into one
buffer, a compiled cocoweave program per bucket that reduces the gradients and updates the weights and state,
its first collective launched from backward hooks, gradient clipping by the global norm with one scalar
all-reduce over all buckets, parameters without a gradient skipped as torch skips them, and torch-style state dicts.

The step of one bucket, with the usual sliced schedule RS-C-AG+slice(m,v) on p ranks:
- backward accumulates each gradient straight into the bucket (`p.grad` is a view); when the last one of the
  bucket is in, a post-accumulate-grad hook launches the reduce-scatter (asynchronously, on the library algorithm;
  the shared-memory algorithm reduces in `step()`, where the gradient buffer is its slot: nothing is copied);
- `step()` runs the program: wait for the reduction, update 1/p of the weights and of exp_avg / exp_avg_sq (kept
  sliced by the executable: 1/p of the memory), all-gather the new weights straight into the parameters (or, with
  gather="forward", leave the gather in flight until a module that uses them runs forward).
On one host the shared-memory reduce-scatter works inside the gradient bucket (this rank's part ends up holding the
reduced gradient: a step needs zero_grad() since the last one), and the parameters are one tensor all ranks map
(each updates its part in place; the all-gather is a barrier): parameters once per host, no result buffers.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import json
import logging
import math
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..backends.torch import shm
from ..backends.torch.placement import metadata_device
from ..compiler import compile as compile_schedule
from ..errors import OptimizerError
from ..ir.graph import Program
from ..ir.types import DTYPES, canonical_dtype
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from .buckets import Bucket, make_buckets

log = logging.getLogger("cocoweave.optim")

REDUCTION_MODES = ("avg", "sum", "adasum")  # how the ranks' gradients combine
GATHERS = ("auto", "step", "forward")
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the optimizer programs take
# torch.optim's implementation switches and flags its param_groups carry (a state dict may lack them)
_TORCH_SWITCHES = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


def world(group: Any = None) -> tuple[int, int]:
    """(rank, size) in `group` (the default process group when None); (0, 1) when torch.distributed is not
    initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


_SCHEDULES: dict[str, list[Schedule]] = {}


def _schedules(program: Program, device: str) -> list[Schedule]:
    """enumerate_schedules for tensors on `device`, memoised by program fingerprint (every bucket of one size shares
    them)."""
    key = f"{program.fingerprint()}/{device}"
    if key not in _SCHEDULES:
        _SCHEDULES[key] = enumerate_schedules(program, device)
    return _SCHEDULES[key]


def norm_reduction(schedule: Schedule) -> str | None:
    """The name of the scalar all-reduce of a clipped program's squared-norm partials (split and reorder insert
    it), or None when the schedule has none (the gradient's all-reduce was not split)."""
    by_name = {v.name: v for v in schedule.program.values}
    for stage in schedule.stages:
        for name in stage.names:
            if by_name[name].op == "all_reduce" and by_name[name].ndim == 0:
                return name
    return None


def resolve_schedule(program: Program, schedule: str, world_size: int, whole: set[str], device: str = "cpu",
                     shared_host: bool = False, clipped: bool = False) -> Schedule:
    """The schedule to run: `schedule` by name, or for "auto" the tuner's cached choice (cocoweave.tune), else the
    schedule keeping the most optimizer state sliced on several ranks (through shared memory when the ranks share a
    CPU host), the fused program as written on one. Schedules that slice a tensor of `whole` (the parameters the
    model reads) are never used; a clipped program needs one whose norm partials are all-reduced."""
    legal = [s for s in _schedules(program, device) if not set(s.sliced_state) & whole
             and (not clipped or norm_reduction(s) is not None)]
    if schedule != "auto":
        for s in legal:
            if s.name == schedule:
                return s
        raise OptimizerError(f"schedule {schedule!r} is not available for program `{program.name}` here; "
                             f"choose one of: auto, {', '.join(s.name for s in legal)}")
    if world_size > 1:
        try:
            from ..tune import cached_schedule
        except ImportError:  # the tuner is optional
            cached_schedule = None
        found = cached_schedule(program, {}, world_size, "torch", device) if cached_schedule else None
        if found is not None and any(s.name == found.name for s in legal):
            return found
    if world_size == 1:
        return next((s for s in legal if s.name in ("AR-C", "C")), legal[0])
    most = max(len(s.sliced_state) for s in legal)
    best = [s for s in legal if len(s.sliced_state) == most and "fuse(" not in s.name
            and not any(st.kind == "compute" and not st.fused for st in s.stages)]  # every computation one loop
    from ..collectives import choose  # on the algorithms by the table of collective algorithms

    return (choose(best, device, shared_host) or legal)[0]


class DistributedOptimizer(torch.optim.Optimizer):
    """Base class: gradient reduction and update in one compiled program per bucket, in place of DDP + a torch
    optimizer. Subclasses name their program, state and runtime scalars."""

    workload: Callable[..., Program]
    state_keys: dict[str, str]  # program state name -> torch state-dict key
    rows = False  # LAMB's [T, N] buckets (one parameter per row)
    has_step = True  # torch's state dict has a per-parameter 'step'
    sparse_grads = False  # torch's optimizer takes sparse gradients (they are densified into the bucket)

    def __init__(self, params: Any, defaults: dict[str, Any], schedule: str = "auto", reduction: str = "avg",
                 max_grad_norm: float | None = None, process_group: Any = None, *, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, gather: str = "auto", master_weights: bool = False,
                 kernels: str | None = None, module: torch.nn.Module | None = None):
        if reduction not in REDUCTION_MODES:
            raise OptimizerError(f"reduction must be one of {', '.join(REDUCTION_MODES)}, got {reduction!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, int | float) and max_grad_norm > 0):
            raise OptimizerError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        if not (isinstance(bucket_cap_mb, int | float) and bucket_cap_mb > 0):
            raise OptimizerError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        if gather not in GATHERS:
            raise OptimizerError(f"gather must be one of {', '.join(GATHERS)}, got {gather!r}")
        if reduction == "adasum" and max_grad_norm is not None:
            raise OptimizerError("max_grad_norm needs a split gradient reduction, which adasum does not have; "
                                 "clip with reduction='avg' or 'sum'")
        _check_torchrun(process_group)
        self.schedule, self.reduction, self.max_grad_norm = schedule, reduction, max_grad_norm
        self.process_group = process_group  # the data-parallel group gradients are reduced over; None: the world
        self.bucket_cap_mb, self.overlap, self.master_weights, self.kernels = bucket_cap_mb, overlap, \
            master_weights, kernels
        self.gather = gather
        self._norm_sq: torch.Tensor | None = None  # the last clipped step's squared norm, on the device
        self.last_step_ms: dict[str, float] = {}  # wall time of the last step's phases (reduce+update+gather)
        self._buckets: list[Bucket] = []
        self._owner: dict[int, Bucket] = {}
        self._sync = True  # no_sync() turns the launches from backward hooks off
        self._deferred: list[Bucket] = []
        self._forward_hook: Any = None
        self._sd_calls = 0
        self._instance = next(_INSTANCES)  # the same on every rank: ranks make their optimizers in the same order
        self._flag_slots: list[torch.Tensor] | None = None
        self._paused: list[tuple[Bucket, Any, Iterator]] | None = None  # steps paused by clip_grad_norm_
        self._gathered: set[int] = set()  # buckets whose sliced state opt.state[p] gathered since its views were set
        self._options = {"schedule": schedule, "reduction": reduction, "process_group": process_group,
                         "bucket_cap_mb": bucket_cap_mb, "overlap": overlap, "gather": gather,
                         "master_weights": master_weights, "kernels": kernels, "module": module}
        super().__init__(params, defaults)
        self._check_same_model()  # before any collective: ranks with other models would hang or abort in them
        self._ensure_buckets()  # compile now, and start every rank from rank 0's parameters, as DDP does
        self._publish_steps()
        if module is not None and world(process_group)[1] > 1:  # DDP's broadcast_buffers: rank 0's before forward
            self._buffer_hook = module.register_forward_pre_hook(self._broadcast_buffers)

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedOptimizer:
        """copy.deepcopy(opt), as torch's: an optimizer of the same class over copies of the parameters, with the
        hyperparameters and a copy of the state (no hooks). A collective (the copy compiles its buckets and the state
        is gathered): copy it on every rank."""
        groups = [{**{k: copy.deepcopy(v, memo) for k, v in g.items() if k != "params"},
                   "params": [copy.deepcopy(p, memo) for p in g["params"]]} for g in self.param_groups]
        options = dict(self._options, max_grad_norm=self.max_grad_norm)
        options["module"] = memo.get(id(options["module"])) if options["module"] is not None else None
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        DistributedOptimizer.__init__(new, groups, copy.deepcopy(self.defaults, memo), **options)
        new.load_state_dict(self.state_dict())
        return new

    def _store_prefix(self) -> str:
        """This optimizer's keys in the job's store: its instance and its group's global ranks, so that optimizers over
        different groups (one per pipeline stage or data-parallel line) never meet on one key."""
        ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
        return f"cocoweave/optim/{self._instance}/g{'-'.join(map(str, ranks))}"

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
        limit = shm.group_timeout(self.process_group)
        difference = None
        if rank != 0:
            try:
                store.wait([f"{key}/0"], datetime.timedelta(seconds=limit))
            except RuntimeError:
                raise OptimizerError(f"rank {rank}: {type(self).__name__} waited {limit:g} s (the process group's "
                                     "timeout) for rank 0 to make its optimizer; make it on every rank") from None
            difference = _first_difference(json.loads(store.get(f"{key}/0")), mine, rank)
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

    # -- hooks of the subclasses ----------------------------------------------------------------
    def check_group(self, group: dict[str, Any]) -> None:
        """Raise OptimizerError for a hyperparameter the optimizer cannot use."""

    def scalars(self, group: dict[str, Any], step: int, b: Bucket) -> dict[str, float]:
        """The program's runtime scalars for one step of bucket b (step counts from 1)."""
        raise NotImplementedError

    def stepped(self, group: dict[str, Any], b: Bucket) -> None:
        """Bucket b took a step with `group`'s hyperparameters (SGD: its momentum buffer now exists)."""

    def initial_state(self, b: Bucket, name: str) -> float:
        """The value state `name` starts at: 0, and for a masked program's per-element counters the bucket's step
        count `t` and whether momentum has `started`."""
        return {"t": float(b.step), "started": float(b.started)}.get(name, 0.0)

    # -- parameter groups and buckets -----------------------------------------------------------
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
            if p.dtype not in _PARAM_DTYPES:
                self.param_groups.pop()
                raise OptimizerError(f"{type(self).__name__}: parameters must be float32, bfloat16 or float16 (the "
                                     f"fused programs' types; float64 and complex are not supported), got {p.dtype} "
                                     f"of shape {list(p.shape)}")
            if "DTensor" in (type(p).__name__, type(p.data).__name__):
                raise OptimizerError(f"{type(self).__name__}: parameters sharded by FSDP2/DTensor are already "
                                     "distributed; use cocoweave's optimizers on plain parameters instead of FSDP")
            if p.device != group["params"][0].device:
                raise OptimizerError(f"{type(self).__name__}: the parameters of one group are on several devices")

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Raise OptimizerError for a hyperparameter of `group` the optimizer cannot use; one-element tensors
        (torch accepts a tensor lr or betas) become their numbers."""
        for name in ("lr",) + tuple(k for k in group if k in ("weight_decay", "eps", "momentum", "dampening")):
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
        cap = 0 if self.reduction == "adasum" else int(self.bucket_cap_mb * 2**20)  # Adasum combines each tensor
        built = False
        for gi, group in enumerate(self.param_groups):
            new = [p for p in group["params"] if p.requires_grad and id(p) not in self._owner]
            if new:
                for b in make_buckets(gi, new, cap, self.rows, world(self.process_group)[1]):
                    self._build(b)
                    self._buckets.append(b)
                    built = True
        if built:
            self._settle()
        return self._buckets

    def _settle(self) -> None:
        """Wait until every rank has put its parameters into their buckets. On one host the ranks share the
        parameters' memory: without this, a rank that goes on (say, to load a checkpoint into the model) could
        have its writes overwritten by a slower rank still copying the parameters in."""
        if world(self.process_group)[1] > 1:
            dist.barrier(group=self.process_group)

    def _program(self, b: Bucket, masked: bool = False) -> Program:
        sizes = {"N": b.shape[-1]} | ({"T": b.shape[0], "rows": True} if self.rows else {})
        return self.workload(**sizes, grad="local", reduction=self.reduction, param_dtype=canonical_dtype(b.dtype),
                             master_weights=self.master_weights, clip=self.max_grad_norm is not None, masked=masked)

    def _whole(self, b: Bucket) -> set[str]:
        """The program inputs the model reads: never sliced."""
        return {"p"} if b.dtype != torch.float32 and self.master_weights else {"w"}

    def _compile(self, b: Bucket, program: Program) -> None:
        """Give bucket b the schedule of `program` this optimizer runs, its executable, and (clipping) the name of
        the squared-norm all-reduce the step pauses before."""
        rank, size = world(self.process_group)
        shared = size > 1 and b.device.type == "cpu" and _one_host(self.process_group)
        clipped = self.max_grad_norm is not None
        b.schedule = resolve_schedule(program, self.schedule, size, self._whole(b), b.device.type, shared, clipped)
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
                    dist.broadcast(p.data, src, group=self.process_group)
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
        grad = b.exe.shared_input("g")
        b.attach(grad, b.exe.shared_input("p" if "p" in b.exe.program.inputs else "w"), keep_grad=keep_grad)
        b.in_slot = grad is not None
        if not keep_grad:  # kept gradients keep their standing (a step without zero_grad() is still refused)
            b.stale = set()

    def _rebuild(self, b: Bucket, masked: bool) -> None:
        """Recompile bucket b's program (masked, or clipping now on), its state carried over; its parameters and
        gradients (values kept) move into the new program's slots, as `_build` puts them there."""
        whole = self._gather_whole(b)
        b.exe.cancel()
        self._compile(b, self._program(b, masked=masked))
        b.masked = masked
        self._place(b, keep_grad=True)
        self._reset_state(b, whole)

    @staticmethod
    def _arriving(b: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        """A hook run before backward accumulates parameter i's gradient: a parameter without `.grad` (after
        zero_grad(set_to_none=True), as torch leaves it) gets its (zeroed) view, so autograd adds into the bucket in
        place instead of making a tensor of its own."""
        p = b.params[i]

        def hook(grad: torch.Tensor) -> None:
            if p.grad is None and grad.layout == torch.strided:
                p.grad = b.grad_view(i)
        return hook

    def _arrived(self, b: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            view = b.part(b.grad, i)
            if p.grad.layout != view.layout or p.grad.data_ptr() != view.data_ptr():  # not the view: copied in
                b.take(i)
            b.version = b.grad._version  # any later in-place change of the gradients shows in this counter
            if not self._sync:  # accumulating under no_sync: the reduction waits for the backward outside it
                return
            b.arrived.add(i)
            if self.overlap and len(b.arrived) == len(b.params):
                b.launched = b.exe.launch({"g": b.grad}) or b.launched
                b.arrived.clear()  # the next backward (accumulation) launches again
        return hook

    def _reset_state(self, b: Bucket, state: Mapping[str, torch.Tensor], master: torch.Tensor | None = None) -> None:
        """Give bucket b this (whole) state, initial values for names not given. The parameters themselves are the
        program's weights (updated in place); fp32 master weights start from them. Sliced state goes to the
        executable, which keeps only its slice (made already sliced when it starts from a constant: no whole copy)."""
        program, sliced = b.exe.program, set(b.schedule.sliced_state)
        model_reads = "p" if "p" in program.inputs else "w"
        b.state = {}
        for n, v in program.inputs.items():
            if v.op != "input" or n in ("g", "active"):
                continue
            if n == model_reads:
                b.state[n] = b.data
                continue
            t = state.get(n, master if n == "w" and master is not None else b.data if n == "w" else None)
            if n in sliced:  # whole: its slice is copied out; the initial value: made as the slice
                b.exe.adopt(n, t.detach().to(DTYPES[v.dtype]).reshape(b.shape) if t is not None else
                            torch.full(b.exe.local_shape(n), self.initial_state(b, n), dtype=DTYPES[v.dtype],
                                       device=b.device))
            elif t is not None:
                b.state[n] = t.detach().to(DTYPES[v.dtype]).reshape(b.shape).clone()
            else:
                b.state[n] = torch.full(b.shape, self.initial_state(b, n), dtype=DTYPES[v.dtype], device=b.device)
        self._publish_views(b)

    # -- the step -------------------------------------------------------------------------------
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
            _finish(steps, exe, phases)
            if b.in_slot:  # this rank's part of the gradient buffer now holds the reduced gradient
                b.stale = set(range(len(b.params)))
            b.step += 1
            self.stepped(self.param_groups[b.group], b)
            b.launched = False
            if self._defer(b):
                self._deferred.append(b)
        if self._deferred and self._forward_hook is None:
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        for b in buckets:
            b.arrived.clear()
            b.zeroed.clear()  # the reduction may have worked inside the gradient buffer
            b.version = None
        self._publish_steps()
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

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients by their global norm, as FSDP's clip_grad_norm_: the norm of the reduced gradient over
        every bucket and rank (one scalar all-reduce), which is what torch.nn.utils.clip_grad_norm_ after DDP
        computes. Returns that norm (before clipping); the next step() applies the clipping. Call it between
        backward() and step(), on every rank."""
        if not (isinstance(max_norm, int | float) and max_norm > 0):
            raise OptimizerError(f"max_norm must be a positive number, got {max_norm!r}")
        if self._paused is not None:
            raise OptimizerError("clip_grad_norm_ was already called for this step; call step() next")
        if self.max_grad_norm is None:  # the programs that clip: rebuilt once, state carried over
            self.max_grad_norm = float(max_norm)
            for b in self._ensure_buckets():
                self._rebuild(b, b.masked)
        self.max_grad_norm = float(max_norm)
        self._paused = self._start(self._ensure_buckets())
        self._clip(self._paused)
        return self._norm_sq.sqrt().to(torch.float32)

    def _defer(self, b: Bucket) -> bool:
        """Leave b's all-gather in flight after step() only when asked (gather="forward"): until it completes, a read
        of the parameters other than a module's forward (a state_dict, an EMA, a norm) sees half-written weights."""
        return self.gather == "forward"

    def _inputs(self, b: Bucket, active: torch.Tensor | None) -> dict[str, Any]:
        """The bucket program's inputs for this step (switching it to its masked program the first time a parameter
        goes without a gradient)."""
        group = self.param_groups[b.group]
        if active is not None and not b.masked:  # for good: per-element step counts start at the bucket's count
            self._rebuild(b, masked=True)
        inputs = {"g": b.grad, **b.state, **self.scalars(group, b.step + 1, b), **self._clip_scalar()}
        if b.masked:
            inputs["active"] = active if active is not None else torch.ones(b.shape, dtype=torch.bool,
                                                                             device=b.device)
        return inputs

    def _clip_scalar(self) -> dict[str, float]:
        return {"max_norm": float(self.max_grad_norm)} if self.max_grad_norm is not None else {}

    def _active(self, buckets: list[Bucket]) -> list[torch.Tensor | None]:
        """Per bucket, which elements to update (None: all of them). A parameter has a gradient if backward reached
        it since the last zero_grad(set_to_none=True), on some rank (the ranks agree, as DDP's reduction makes them),
        or the user gave it one; torch skips the others."""
        flags = []
        for b in buckets:
            self._check_grads(b)
            none = set(b.restore_views())
            if b.stale:
                raise OptimizerError(
                    f"{type(self).__name__}: step() was called without zero_grad() since the last step; the gradient "
                    "buffers were reduced in place (on one host the reduction works inside them), so gradients cannot "
                    "accumulate across steps. Call opt.zero_grad() (or model.zero_grad()) after each step, and "
                    "accumulate micro-batches with opt.no_sync() before one step instead")
            flags.append([0 if i in none else 1 for i in range(len(b.params))])
        have = self._agree([f for fs in flags for f in fs])
        out, k = [], 0
        for b, fs in zip(buckets, flags, strict=True):
            mine, k = have[k:k + len(fs)], k + len(fs)
            if all(mine) and not b.masked:
                out.append(None)
                continue
            mask = torch.zeros(b.shape, dtype=torch.bool, device=b.device)
            for i, h in enumerate(mine):
                if h:
                    b.part(mask, i).fill_(True)
            out.append(mask)
        return out

    def _check_grads(self, b: Bucket) -> None:
        """A sparse `.grad` set by hand where torch's optimizer refuses one, refused with torch's sentence."""
        if self.sparse_grads:
            return
        for p in b.params:
            if p.grad is not None and p.grad.layout != torch.strided:
                raise OptimizerError(f"{type(self).__name__} does not support sparse gradients (a parameter of shape "
                                     f"{list(p.shape)} has a {p.grad.layout} one), as torch's "
                                     f"{type(self).__name__.removeprefix('Distributed')} does not; use a dense "
                                     "gradient, or DistributedSGD")

    def _agree(self, flags: list[int]) -> list[int]:
        """The maximum over the ranks of each flag, as DDP's find_unused_parameters all-reduces its used-parameter
        map: through shared memory on one host, else one small all-reduce."""
        _, size = world(self.process_group)
        if size == 1 or not flags:
            return flags
        t = torch.tensor(flags, dtype=torch.int32)
        g = shm.group_for(self.process_group)
        if g is None:  # NCCL alone takes no CPU tensor: the flags go where the group takes them
            t = t.to(metadata_device(self.process_group, self._buckets[0].device))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            return t.tolist()
        if self._flag_slots is None or self._flag_slots[0].numel() != t.numel():
            self._flag_slots = g.slots("optim-flags", t.numel(), torch.int32)
        out = torch.empty_like(t)
        shm.all_reduce(g, self._flag_slots, t, "max", [(0, t.numel()) if j == 0 else (t.numel(), 0)
                                                      for j in range(g.size)], out)
        return out.tolist()

    def _clip(self, runs: list[tuple[Bucket, Any, Iterator]]) -> None:
        """Clip by the global norm of the reduced gradient, as torch.nn.utils.clip_grad_norm_ after DDP: each
        bucket's program stops before the all-reduce of its squared-norm partial (split and reorder put it there);
        the partials of all buckets are summed and all-reduced once; every bucket then gets that total."""
        partials, names = [], []
        for b, exe, steps in runs:
            name = b.norm
            while True:
                index, reads = next(steps)
                if name in exe.plan.stages[index].names:
                    break
            partials.append(next(iter(reads.values())).double())
            names.append(name)
        total = torch.stack(partials).sum() if partials else torch.zeros(
            (), dtype=torch.float64, device=self._buckets[0].device if self._buckets else None)  # as partials
        if world(self.process_group)[1] > 1:
            dist.all_reduce(total, group=self.process_group)
        for (_, exe, _), name in zip(runs, names, strict=True):
            exe.provide(name, total.to(torch.float32))
        self._norm_sq = total  # read on demand (last_grad_norm): no device sync in the step

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last clipped step (None before one); read from the device when asked."""
        return None if self._norm_sq is None else math.sqrt(float(self._norm_sq))

    # -- gradients, and the all-gathers left in flight ------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers. As torch: with set_to_none every `.grad` becomes None (backward then
        accumulates into the bucket again: a hook gives each parameter its view back), and a parameter backward does
        not reach before the next step is skipped, not updated with zeros; without it the `.grad` views are zeros."""
        if self._paused is not None:
            raise OptimizerError("clip_grad_norm_ reduced this step's gradients: call step() before zero_grad()")
        for group in self.param_groups:  # parameters the buckets do not hold (frozen ones), as torch does
            for p in group["params"]:
                if p.grad is not None and id(p) not in self._owner:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad = p.grad.detach().zero_()
        for b in self._ensure_buckets():
            b.version = None
            if b.launched:
                b.exe.cancel()
                b.launched = False
            b.restore_views(copy=False)
            b.grad.zero_()
            b.stale = set()
            b.arrived.clear()
            b.zeroed = set(range(len(b.params)))
            for i, p in enumerate(b.params):  # as torch: a None gradient stays None either way
                p.grad = None if set_to_none or p.grad is None else b.part(b.grad, i)

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

    def _broadcast_buffers(self, module: torch.nn.Module, args: Any) -> None:
        """Module buffers (BatchNorm's running statistics) become rank 0's before each forward, as DDP does."""
        buffers = [b for b in module.buffers() if b.is_floating_point() or b.dtype == torch.int64]
        if not buffers or not module.training:
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for dtype in sorted({b.dtype for b in buffers}, key=str):  # the same order on every rank
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.reshape(-1) for b in same])
            dist.broadcast(flat, src, group=self.process_group)
            for b, part in zip(same, flat.split([b.numel() for b in same]), strict=True):
                b.copy_(part.view_as(b))

    @property
    def schedules(self) -> list[str]:
        """The schedule each bucket runs (chosen by `schedule`, e.g. "auto": the tuned or most-sliced one)."""
        return [b.schedule.name for b in self._ensure_buckets()]

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A module is about to run: the all-gathers of its parameters' buckets complete first."""
        for p in module._parameters.values():
            b = self._owner.get(id(p)) if p is not None else None
            if b is not None and b in self._deferred:
                self._deferred.remove(b)
                b.exe.wait()
        if not self._deferred:
            self.wait()

    # -- state dicts ----------------------------------------------------------------------------
    def _gather_whole(self, b: Bucket) -> dict[str, torch.Tensor]:
        """Every state tensor of bucket b, whole (a collective when the executable keeps some sliced)."""
        return {**b.state, **{n: b.exe.gather_state(n) for n in b.exe.plan.sliced_state if n not in b.state}}

    def _publish_steps(self) -> None:
        """`opt.state[p]["step"]` as torch users read it (so that torch's checkpoint helpers see an initialised
        optimizer); the state views are set when a bucket's state is (`_publish_views`)."""
        if not self.has_step:
            return
        for b in self._buckets:
            for p in b.params:
                self.state[p].setdefault("step", torch.zeros(())).fill_(float(b.step))

    def _publish_views(self, b: Bucket) -> None:
        """`opt.state[p]`'s exp_avg / exp_avg_sq / momentum_buffer: views of the bucket's state where this rank holds
        it whole (valid while the bucket's state tensors are: they are updated in place); where ranks keep it sliced,
        gathered when first read after a step (a collective, as state_dict(): every rank reads it)."""
        self._gathered.discard(id(b))
        for i, p in enumerate(b.params):
            entry = self.state[p]
            if not isinstance(entry, _ParamState):
                entry = self.state[p] = _ParamState(entry)
            entry.gather = None
            for n, key in self.state_keys.items():
                if n in b.state:
                    dict.__setitem__(entry, key, b.part(b.state[n], i))
                elif n in b.exe.plan.sliced_state:
                    dict.__setitem__(entry, key, _SLICED)
                    entry.gather = lambda b=b: self._gather_views(b)

    def _gather_views(self, b: Bucket) -> None:
        """Gather bucket b's sliced state into its parameters' `opt.state[p]` (until the next step)."""
        if self._sliced():
            self._meet("state[p] (reading exp_avg, exp_avg_sq or momentum_buffer)")
        whole = self._gather_whole(b)
        self._gathered.add(id(b))
        for i, p in enumerate(b.params):
            entry = self.state[p]
            for n, key in self.state_keys.items():
                if n in b.exe.plan.sliced_state:
                    dict.__setitem__(entry, key, b.part(whole[n], i))
            entry.gather = None

    def _meet(self, what: str) -> None:
        """Wait until every rank of the group has called `what` (a collective: it gathers state kept sliced), as long
        as the process group's timeout; a rank that waited in vain withdraws its arrival, so that the next call of
        every rank meets again (no hang, no rank left one call ahead), and says so."""
        rank, size = world(self.process_group)
        store = dist.distributed_c10d._get_default_store()
        self._sd_calls += 1
        key = f"{self._store_prefix()}/collective/{self._sd_calls}"
        arrived = store.add(key, 1)
        limit = shm.group_timeout(self.process_group)
        deadline = time.monotonic() + limit
        while arrived < size:
            if time.monotonic() >= deadline:
                if store.compare_set(key, str(arrived), str(arrived - 1)) == str(arrived - 1).encode():
                    self._sd_calls -= 1  # withdrawn: this rank's next call meets the others' at the same key
                    raise OptimizerError(
                        f"rank {rank}: {type(self).__name__}.{what} gathers optimizer state that ranks keep sliced "
                        f"({self._buckets[0].schedule.name}), so every rank must call it; only {arrived} of {size} "
                        f"did within the process group's timeout ({limit:g} s). Call it on every rank (and save on "
                        "one), or use schedule='AR-C' to keep whole state on each rank.")
                # a rank arrived meanwhile: look again
            time.sleep(0.005)
            arrived = store.add(key, 0)

    def _sliced(self) -> bool:
        return world(self.process_group)[1] > 1 and any(b.exe.plan.sliced_state for b in self._buckets)

    def state_dict(self) -> dict[str, Any]:
        """A torch-style state dict with whole (gathered) state per parameter, loadable at any world size (and by
        the torch optimizer of the same name); with fp32 master weights, also 'master_param'. torch's state-dict
        hooks run around it, the post-hooks on the whole state. Every rank must call it when state is kept sliced
        (gathering is a collective); a rank alone is told so within the process group's timeout."""
        self.wait()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        buckets = self._ensure_buckets()
        if self._sliced():
            self._meet("state_dict()")
        saved = self.state, self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks
        self.state, self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = \
            type(saved[0])(), OrderedDict(), OrderedDict()
        try:
            out = super().state_dict()  # torch's packing of the groups
        finally:
            self.state, self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = saved
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for b in buckets:  # every parameter, a fresh optimizer's at step 0 (a template DCP can fill)
            whole = self._gather_whole(b)
            for i, p in enumerate(b.params):
                step = int(b.part(whole["t"], i).reshape(-1)[0]) if "t" in whole and p.numel() else b.step
                entry = {key: b.part(whole[n], i).detach().clone() for n, key in self.state_keys.items()
                         if self.has_state(b, whole, i)}
                if self.has_step:
                    entry = {"step": torch.tensor(float(step))} | entry
                if "w" in whole and "p" in b.exe.program.inputs:
                    entry["master_param"] = b.part(whole["w"], i).detach().clone()
                out["state"][index[id(p)]] = entry
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    def has_state(self, b: Bucket, whole: Mapping[str, torch.Tensor], i: int) -> bool:
        """Whether torch's state of parameter i of bucket b has the `state_keys` tensors (SGD: only once momentum
        started)."""
        return True

    def _loaded_groups(self, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Our parameter groups with the saved hyperparameters, as torch's load_state_dict makes them, checked as
        add_param_group checks a group; raises OptimizerError (changing nothing) for a state dict that does not
        fit: another number of groups or parameters, a hyperparameter missing (another optimizer's state dict) or
        one this optimizer cannot run (maximize=True, amsgrad=True)."""
        name = type(self).__name__
        if len(saved_groups) != len(self.param_groups):
            raise OptimizerError(f"{name}.load_state_dict: the state dict has {len(saved_groups)} parameter groups, "
                                 f"this optimizer {len(self.param_groups)}")
        groups = []
        for gi, (group, saved) in enumerate(zip(self.param_groups, copy.deepcopy(saved_groups), strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise OptimizerError(f"{name}.load_state_dict: group {gi} of the state dict has "
                                     f"{len(saved['params'])} parameters, this optimizer's {len(group['params'])}")
            missing = [k for k in self.defaults if k not in saved and k not in _TORCH_SWITCHES]
            if missing:
                raise OptimizerError(f"{name}.load_state_dict: group {gi} of the state dict has no "
                                     f"{', '.join(map(repr, missing))}: it was saved by another optimizer (its "
                                     f"hyperparameters: {', '.join(sorted(k for k in saved if k != 'params'))})")
            new = {**{k: v for k, v in group.items() if k in _TORCH_SWITCHES}, **saved, "params": group["params"]}
            if "param_names" in group and "param_names" not in saved:
                new["param_names"] = group["param_names"]
            try:
                self._check_hyperparameters(new)
            except OptimizerError as exc:
                raise OptimizerError(f"{name}.load_state_dict: group {gi} of the state dict: "
                                     f"{str(exc).removeprefix(name + ': ')}") from None
            groups.append(new)
        return groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved at any world size (or by the torch optimizer of the same name): the
        hyperparameters of every group, and the state, resliced for this world size. As torch: the load pre-hooks
        may edit or replace the state dict first, the post-hooks run once it is in place. All or nothing: a state
        dict that does not fit raises OptimizerError and changes nothing."""
        self.wait()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self._loaded_groups(state_dict["param_groups"])
        saved = state_dict.get("state", {})
        # as torch: the saved groups list their parameters' keys (indices, or names from torch's DCP helpers) in the
        # order of ours
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        entry_of = {id(p): saved.get(k, saved.get(str(k))) for p, k in zip(params, keys, strict=True)}
        plans = [self._loaded_state(b, [entry_of[id(p)] for p in b.params]) for b in self._ensure_buckets()]
        # nothing failed: from here on the optimizer changes
        self.param_groups[:] = groups
        rebuilt = False
        for b, (step, masked, state, master, started) in zip(self._buckets, plans, strict=True):
            if masked and not b.masked:
                self._rebuild(b, masked=True)
                rebuilt = True
            b.step, b.started = step, started
            self._reset_state(b, state, master)
        if rebuilt:  # (collective, as the rebuild itself) parameters moved into new buckets
            self._settle()
        self._publish_steps()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_state(self, b: Bucket, entries: list[dict[str, Any] | None]) -> tuple:
        """Bucket b's state from the saved entries of its parameters, checked and built before anything changes:
        (step, whether it needs the masked program, whole state tensors, fp32 masters or None, momentum started)."""
        if all(e is None for e in entries):
            return 0, b.masked, {}, None, False
        steps = {int(e["step"]) for e in entries if e is not None and "step" in e} or {1}
        has = [e is not None and all(key in e for key in self.state_keys.values()) for e in entries]
        masked = b.masked or len(steps) > 1 or any(e is None for e in entries) or (
            not self.has_step and any(has) and not all(has))
        shape = (*b.shape[:-1], b.shape[-1])
        try:
            zeros = dict(size=shape, dtype=torch.float32, device=b.device)
            state = {n: b.fill(torch.zeros(**zeros), [e[key] if h else None for e, h in zip(entries, has)])
                     for n, key in self.state_keys.items()}
            if masked:
                state["t"] = b.fill(torch.zeros(**zeros), [float(e["step"]) if e is not None and "step" in e else
                                                           0.0 for e in entries])
                state["started"] = b.fill(torch.zeros(**zeros), [1.0 if h else 0.0 for h in has])
            master = None
            if b.dtype != torch.float32 and self.master_weights:
                master = b.fill(b.data.float().clone(), [e.get("master_param") if e is not None else None
                                                         for e in entries])
        except (KeyError, RuntimeError, TypeError) as exc:
            raise OptimizerError(f"{type(self).__name__}.load_state_dict: the state of group {b.group} does not "
                                 f"match its parameters ({exc})") from None
        return max(steps), masked, state, master, any(has)

    def __repr__(self) -> str:
        head = super().__repr__()
        lines = [f"    bucket {i}: {len(b.params)} parameters, {b.numel} elements, {b.schedule.name}"
                 for i, b in enumerate(self._buckets)]
        return head[:-1] + "\n".join(["Buckets (schedule):", *lines]) + "\n)"


_INSTANCES = itertools.count()


def _first_difference(theirs: list, mine: list, rank: int) -> str | None:
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


_SLICED = object()  # opt.state[p]'s value of state the ranks keep sliced, until read


class _ParamState(dict):
    """`opt.state[p]`, a dict with torch's keys, whose state kept sliced is gathered (once per step, on every rank)
    when first read."""

    gather: Callable[[], None] | None = None

    def _value(self, key: Any, value: Any) -> Any:
        if value is _SLICED and self.gather is not None:
            self.gather()
            value = dict.__getitem__(self, key)
        return value

    def __getitem__(self, key: Any) -> Any:
        return self._value(key, dict.__getitem__(self, key))

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self) -> Any:
        return [self[k] for k in self]

    def items(self) -> Any:
        return [(k, self[k]) for k in self]


PHASES = {"reduce_scatter": "reduce", "all_reduce": "reduce", "all_gather": "gather"}


def _finish(steps: Iterator, exe: Any, phases: dict[str, float]) -> Any:
    """Run a paused step to its end, adding the wall time of its stages to `phases` ("reduce": the gradient's
    reduce-scatter or all-reduce, "update": computation, "gather": the all-gathers of new weights)."""
    t, phase = time.perf_counter(), None
    try:
        while True:
            index, _ = next(steps)
            now = time.perf_counter()
            if phase is not None:
                phases[phase] = phases.get(phase, 0.0) + (now - t) * 1e3
            stage = exe.plan.stages[index]
            phase, t = PHASES.get(getattr(stage, "op", ""), "gather" if getattr(stage, "op", "") else "update"), now
    except StopIteration as done:
        if phase is not None:
            phases[phase] = phases.get(phase, 0.0) + (time.perf_counter() - t) * 1e3
        return done.value


def _one_host(group: Any) -> bool:
    """Whether every rank of `group` runs on this host (the shared-memory algorithm then applies)."""
    return shm.group_for(group) is not None


def _check_torchrun(group: Any) -> None:
    """Under torchrun with several ranks, torch.distributed must be initialised: each rank would train alone."""
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise OptimizerError(f"this process is one of {size} ranks (WORLD_SIZE={size}) but torch.distributed is not "
                             "initialised: call torch.distributed.init_process_group() (or "
                             "cocoweave.launch.init_from_env()) before creating the optimizer, or each rank trains "
                             "alone")
