"""The torch face of the distributed optimizers: DistributedOptimizer, a torch.optim.Optimizer whose jobs each live
in a file of their own, as mixins: buckets whose parameters and gradients are views into one buffer (buckets.py,
sized by bucket_policy.py, built and compiled by bucket_set.py, one compiled program per bucket reached through
bucket_program.py), the step driven stage by stage (stepping.py), its first collective launched from backward hooks
and DDP's other behaviours (ddp.py), gradient clipping by the global norm with one scalar all-reduce over all buckets
(clipping.py), parameters without a gradient skipped as torch skips them (masks.py), torch-style state dicts
(state_dicts.py); the schedule each bucket runs (schedule_choice.py), the job's store keys (ranks.py). The group's
facts (rank, size, one host, timeout, the flag all-reduce) are cocoweave.group_facts'. The programs' input and state
names are workloads/optimizer_contract.py's.

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

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..errors import OptimizerError
from ..group_facts import world
from ..ir.graph import Program
from ..workloads.optimizer_contract import STARTED, STEPS
from .bucket_set import BucketSet
from .buckets import Bucket
from .clipping import Clipping, clip
from .ddp import DDPBehaviours
from .masks import Masks, agree
from .ranks import INSTANCES, check_torchrun
from .schedule_choice import norm_reduction, resolve_schedule
from .state_dicts import StateDicts
from .stepping import Stepping

__all__ = ["DistributedOptimizer", "norm_reduction", "resolve_schedule", "world"]

REDUCTION_MODES = ("avg", "sum", "adasum")  # how the ranks' gradients combine
GATHERS = ("auto", "step", "forward")


class DistributedOptimizer(BucketSet, Stepping, Clipping, Masks, DDPBehaviours, StateDicts, torch.optim.Optimizer):
    """Base class: gradient reduction and update in one compiled program per bucket, in place of DDP + a torch
    optimizer. Subclasses name their program, state and runtime scalars. Each job is a mixin of its own file: the
    bucket set (bucket_set.py), the step (stepping.py), clipping, masks, DDP's behaviours (ddp.py), state dicts."""

    workload: Callable[..., Program]
    state_keys: dict[str, str]  # program state name -> torch state-dict key
    rows = False  # LAMB's [T, N] buckets (one parameter per row)
    has_step = True  # torch's state dict has a per-parameter 'step'
    sparse_grads = False  # torch's optimizer takes sparse gradients (they are densified into the bucket)

    def __init__(self, params: Any, defaults: dict[str, Any], schedule: str = "auto", reduction: str = "avg",
                 max_grad_norm: float | None = None, process_group: Any = None, *, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, gather: str = "auto", master_weights: bool = False,
                 kernels: str | None = None, module: torch.nn.Module | None = None, broadcast_buffers: bool = True):
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
        check_torchrun(process_group)
        self.schedule, self.reduction, self.max_grad_norm = schedule, reduction, max_grad_norm
        self.process_group = process_group  # the data-parallel group gradients are reduced over; None: the world
        self.bucket_cap_mb, self.overlap, self.master_weights, self.kernels = bucket_cap_mb, overlap, \
            master_weights, kernels
        self.gather = gather
        self._norm_sq: torch.Tensor | None = None  # the last clipped step's squared norm, on the device
        self.last_step_ms: dict[str, float] = {}  # wall time of the last step's phases (reduce+update+gather)
        self._buckets: list[Bucket] = []
        self._owner: dict[int, Bucket] = {}
        self._groups_seen: list[tuple[list, int]] = []  # each group's parameter list and its length, when last looked
        self._unbucketed: list[tuple[int, torch.Tensor]] = []  # (group, parameter) of those not in a bucket
        self._sync = True  # no_sync() turns the launches from backward hooks off
        self._deferred: list[Bucket] = []
        self._forward_hook: Any = None
        self._sd_calls = 0
        self._instance = next(INSTANCES)  # the same on every rank: ranks make their optimizers in the same order
        self._flag_slots: list[torch.Tensor] | None = None
        self._paused: list[tuple[Bucket, Any, Iterator]] | None = None  # steps paused by clip_grad_norm_
        self._gathered: set[int] = set()  # buckets whose sliced state opt.state[p] gathered since its views were set
        self._options = {"schedule": schedule, "reduction": reduction, "process_group": process_group,
                         "bucket_cap_mb": bucket_cap_mb, "overlap": overlap, "gather": gather,
                         "master_weights": master_weights, "kernels": kernels, "module": module,
                         "broadcast_buffers": broadcast_buffers}
        self._buffer_modules: dict[int, torch.nn.Module] = {}  # modules whose buffers step() makes rank 0's
        self._finder: Any = None
        super().__init__(params, defaults)
        self._check_same_model()  # before any collective: ranks with other models would hang or abort in them
        self._ensure_buckets()  # compile now, and start every rank from rank 0's parameters, as DDP does
        self._publish_steps()
        if broadcast_buffers and world(process_group)[1] > 1:  # DDP's broadcast_buffers (ddp.py)
            if module is not None:  # rank 0's before each forward, as DDP
                self._buffer_hook = module.register_forward_pre_hook(self._broadcast_buffers)
            else:  # the modules the first forward runs that hold our parameters and buffers: rank 0's at each step
                self._finder = torch.nn.modules.module.register_module_forward_pre_hook(self._find_buffers)

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
        return {STEPS: float(b.step), STARTED: float(b.started)}.get(name, 0.0)

    def has_state(self, b: Bucket, whole: Mapping[str, torch.Tensor], i: int) -> bool:
        """Whether torch's state of parameter i of bucket b has the `state_keys` tensors (SGD: only once momentum
        started)."""
        return True

    def state_shape(self, b: Bucket, name: str) -> tuple[int, ...]:
        """The shape of bucket b's state `name`: the bucket's, one element per parameter element. The one place the
        optimizer assumes state bucket-shaped: a factored optimizer (Adafactor's row and column statistics)
        overrides this and `state_part`."""
        return b.shape

    def state_part(self, b: Bucket, name: str, t: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of bucket b's state tensor `name` (a view): what torch's state of it holds."""
        return b.part(t, i)

    def _state_from(self, b: Bucket, name: str, parts: list[torch.Tensor | float | None]) -> torch.Tensor:
        """Bucket b's state `name` (float32 zeros) with parameter i's part written from parts[i] (a tensor of its
        elements, a number for all of them, or None: left 0), as Bucket.fill writes a bucket-shaped buffer."""
        t = torch.zeros(self.state_shape(b, name), dtype=torch.float32, device=b.device)
        for i, v in enumerate(parts):
            part = self.state_part(b, name, t, i)
            if isinstance(v, torch.Tensor):
                part.copy_(v.reshape(part.shape))
            elif v is not None:
                part.fill_(v)
        return t

    # -- what the ranks agree on (the group's size read here) -----------------------------------
    def _agree(self, flags: list[int]) -> list[int]:
        """The maximum over the ranks of each flag (masks.agree)."""
        return agree(self, flags, world(self.process_group)[1])

    def _clip(self, runs: list[tuple[Bucket, Any, Iterator]]) -> None:
        """Clip this step's paused runs by the global norm of the reduced gradient (clipping.clip)."""
        clip(self, runs, world(self.process_group)[1])

    def __repr__(self) -> str:
        head = super().__repr__()
        lines = [f"    bucket {i}: {len(b.params)} parameters, {b.numel} elements, {b.schedule.name}"
                 for i, b in enumerate(self._buckets)]
        return head[:-1] + "\n".join(["Buckets (schedule):", *lines]) + "\n)"
