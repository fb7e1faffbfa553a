"""The machinery shared by the distributed optimizers: buckets of parameters flattened into one
program instance, schedule resolution, gradient clipping, and gathered/resharded state dicts.

A *bucket* is the parameters of one parameter group with one dtype (LAMB: and one size, as the
columns of an [N, T] program). Its gradients are copied into one float32 buffer, the compiled
program reduces them and updates float32 weights (the master copy for bf16/fp16 parameters) and
the optimizer state in place, and the new weights are copied back into the parameters. State that
the schedule keeps sliced lives in the executable between steps (1/world of the memory).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from ..compiler import compile as compile_schedule
from ..errors import OptimizerError
from ..ir.graph import Program
from ..schedule.enumerate import enumerate_schedules
from ..schedule.schedule import Schedule
from ..workloads.optimizers import reduce_gradient

REDUCTIONS = ("avg", "sum", "adasum")
_PARAM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (total_norm + 1e-6)


def world(group: Any = None) -> tuple[int, int]:
    """(rank, size) in `group` (the default process group when None); (0, 1) when torch.distributed is not
    initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def resolve_schedule(program: Program, schedule: str, world_size: int, whole: Collection[str],
                     device: str = "cpu") -> Schedule:
    """The schedule to run: `schedule` by name, or for "auto" the tuner's cached choice (cocoweave.tune)
    else the schedule keeping the most optimizer state sliced (RS-C-AG+slice(...)) on several ranks,
    the fused program as written on one. Schedules that slice a tensor of `whole` (the parameters
    the model reads) are never used."""
    legal = [s for s in _schedules(program) if not set(s.sliced_state) & set(whole)]
    if schedule != "auto":
        for s in legal:
            if s.name == schedule:
                return s
        raise OptimizerError(f"schedule {schedule!r} is not available for program `{program.name}` here; "
                             f"choose one of: auto, {', '.join(s.name for s in legal)}")
    if world_size > 1:  # one rank communicates nothing: there is nothing to tune
        try:
            from ..tune import cached_schedule
        except ImportError:  # the tuner is optional
            cached_schedule = None
        found = cached_schedule(program, {}, world_size, "torch", device) if cached_schedule else None
        if found is not None and not set(found.sliced_state) & set(whole):
            return found
    most = max(len(s.sliced_state) for s in legal)
    if most and world_size > 1:
        return next(s for s in legal if len(s.sliced_state) == most)
    return next((s for s in legal if s.name in ("AR-C", "C")), legal[0])


_SCHEDULES: dict[str, list[Schedule]] = {}


def _schedules(program: Program) -> list[Schedule]:
    """enumerate_schedules, memoised by program fingerprint (every bucket of one size shares them)."""
    key = program.fingerprint()
    if key not in _SCHEDULES:
        _SCHEDULES[key] = enumerate_schedules(program)
    return _SCHEDULES[key]


@dataclass
class Bucket:
    """The parameters of one group (and dtype, and for LAMB size) run by one program instance."""

    group: int
    params: list[torch.nn.Parameter]
    columns: bool  # LAMB: [N, T], parameter t is column t; else [N], parameters one after another
    offsets: list[int] = field(default_factory=list)
    step: int = 0
    schedule: Schedule | None = None
    exe: Any = None
    grad: torch.Tensor | None = None  # the flat float32 gradient, reused by every step
    reducer: Any = None  # the gradient all_reduce used before clipping by global norm
    owned: dict[str, torch.Tensor] = field(default_factory=dict)  # state passed to every call
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # sliced state to give on the next call

    def __post_init__(self) -> None:
        if self.columns:
            self.offsets = [0] * len(self.params)
        else:
            self.offsets = list(accumulate((p.numel() for p in self.params[:-1]), initial=0))

    @property
    def shape(self) -> tuple[int, ...]:
        if self.columns:
            return (self.params[0].numel(), len(self.params))
        return (sum(p.numel() for p in self.params),)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    def flat(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=dtype, device=self.params[0].device)

    def part(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's elements in a flat buffer, as a (possibly strided) 1-dim view."""
        if self.columns:
            return buf[:, i]
        return buf[self.offsets[i]:self.offsets[i] + self.params[i].numel()]

    def gather(self, tensors: Iterable[torch.Tensor | None], dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """A flat buffer (`out`, or a new one) holding one tensor per parameter (None: zeros)."""
        buf = self.flat(dtype) if out is None else out
        for i, t in enumerate(tensors):
            if t is None:
                self.part(buf, i).zero_()
            else:
                self.part(buf, i).copy_(t.reshape(-1))
        return buf

    def scatter(self, buf: torch.Tensor, into: Iterable[torch.Tensor]) -> None:
        """Copy each parameter's part of `buf` into the matching tensor of `into`."""
        with torch.no_grad():
            for i, t in enumerate(into):
                t.copy_(self.part(buf, i).reshape(t.shape))


class DistributedOptimizer(torch.optim.Optimizer):
    """Base class: gradient reduction and update in one tuned program per bucket, in place of DDP +
    a torch optimizer. Subclasses name their program, state and runtime scalars."""

    workload: Callable[..., Program]
    state_keys: dict[str, str]  # program state name -> torch state-dict key
    columns = False  # LAMB's [N, T] buckets
    has_step = True  # torch's state dict has a per-parameter 'step'

    def __init__(self, params: Any, defaults: dict[str, Any], schedule: str = "auto", reduction: str = "avg",
                 max_grad_norm: float | None = None, process_group: Any = None):
        if reduction not in REDUCTIONS:
            raise OptimizerError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise OptimizerError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self.schedule, self.reduction, self.max_grad_norm = schedule, reduction, max_grad_norm
        self.process_group = process_group  # the data-parallel group gradients are reduced over; None: the world
        self.last_grad_norm: float | None = None
        self._buckets: list[Bucket] = []
        super().__init__(params, defaults)
        self._ensure_buckets()  # compile now, and start every rank from rank 0's parameters, as DDP does

    # -- hooks of the subclasses ----------------------------------------------------------------
    def check_group(self, group: dict[str, Any]) -> None:
        """Raise OptimizerError for a hyperparameter the optimizer cannot use."""

    def scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        """The program's runtime scalars for one step (step counts from 1)."""
        raise NotImplementedError

    # -- buckets --------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name in ("lr",) + tuple(k for k in group if k in ("weight_decay", "eps", "momentum")):
            value = group[name]
            if isinstance(value, torch.Tensor) or not isinstance(value, int | float) or value < 0:
                raise OptimizerError(f"{type(self).__name__}: {name} must be a non-negative number, got {value!r}")
        self.check_group(group)
        for p in group["params"]:
            if p.dtype not in _PARAM_DTYPES:
                raise OptimizerError(f"{type(self).__name__}: parameters must be float32, bfloat16 or float16, "
                                     f"got {p.dtype} of shape {list(p.shape)}")
            if p.device != group["params"][0].device:
                raise OptimizerError(f"{type(self).__name__}: the parameters of one group are on several devices")

    def _ensure_buckets(self) -> list[Bucket]:
        """Buckets (compiled) for every parameter group not yet bucketed."""
        done = {b.group for b in self._buckets}
        for gi, group in enumerate(self.param_groups):
            if gi in done:
                continue
            keys: dict[tuple, list] = {}
            for p in group["params"]:
                keys.setdefault((p.dtype, p.numel()) if self.columns else (p.dtype,), []).append(p)
            for params in keys.values():
                self._buckets.append(self._build(Bucket(gi, params, self.columns)))
        return self._buckets

    def _build(self, b: Bucket) -> Bucket:
        rank, size = world(self.process_group)
        device = b.params[0].device
        param_dtype = _PARAM_DTYPES[b.dtype]
        sizes = {"N": b.shape[0]} | ({"T": b.shape[1]} if self.columns else {})
        # One rank has nothing to reduce: the update runs on the gradient as it is. Clipping by global
        # norm needs the whole reduced gradient before any update: it is reduced first, then updated.
        grad = "reduced" if size == 1 or self.max_grad_norm is not None else "local"
        program = self.workload(**sizes, grad=grad, reduction=self.reduction, param_dtype=param_dtype)
        whole = {"p"} if b.low_precision else {"w"}
        if grad == "reduced" and self.schedule != "auto":  # validate the name, though nothing is left to schedule
            resolve_schedule(self.workload(**sizes, reduction=self.reduction, param_dtype=param_dtype),
                             self.schedule, 2, whole)
            b.schedule = resolve_schedule(program, "auto", size, whole, device.type)
        else:
            b.schedule = resolve_schedule(program, self.schedule, size, whole, device.type)
        b.exe = compile_schedule(b.schedule, "torch", device=device, rank=rank, world_size=size,
                                 group=self.process_group)
        if grad == "reduced" and size > 1:
            b.reducer = compile_schedule(reduce_gradient(b.shape, self.reduction), "torch", device=device,
                                         rank=rank, world_size=size, group=self.process_group)
        params = b.gather(b.params, b.dtype)
        if size > 1:
            src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
            dist.broadcast(params, src, group=self.process_group)
            b.scatter(params, b.params)
        b.grad = b.flat()
        self._reset_state(b, {}, params.float())
        return b

    def _reset_state(self, b: Bucket, state: Mapping[str, torch.Tensor], master: torch.Tensor) -> None:
        """Give bucket b this (whole) state; zeros for names not given. Sliced state is handed to the
        executable on the next call, which keeps its slice."""
        sliced = set(b.schedule.sliced_state)
        full = {n: state.get(n, b.flat()) for n in self.state_keys} | {"w": master}
        if b.low_precision:
            full["p"] = b.flat(b.dtype)
        b.owned = {n: t for n, t in full.items() if n not in sliced}
        b.pending = {n: t for n, t in full.items() if n in sliced}

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients and update the parameters with each bucket's compiled schedule."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets = self._ensure_buckets()
        if all(p.grad is None for b in buckets for p in b.params):
            return loss  # like torch: nothing to update (a parameter without a gradient otherwise counts as 0)
        grads = []
        for b in buckets:
            for p in b.params:
                if p.grad is not None and p.grad.is_sparse:
                    raise OptimizerError(f"{type(self).__name__} does not support sparse gradients")
            grads.append(b.gather((p.grad for p in b.params), out=b.grad))
        if self.max_grad_norm is not None:
            self._clip(buckets, grads)
        for b, g in zip(buckets, grads, strict=True):
            b.step += 1
            if not b.low_precision:  # float32 parameters are the weights: read them (the user may have changed them)
                b.gather(b.params, out=b.owned["w"])
            inputs = {"g": g, **b.owned, **b.pending, **self.scalars(self.param_groups[b.group], b.step)}
            b.exe.run(inputs)
            b.pending = {}
            b.scatter(b.owned["p" if b.low_precision else "w"], b.params)
        return loss

    def _clip(self, buckets: list[Bucket], grads: list[torch.Tensor]) -> None:
        """Reduce the gradients, then scale them like torch.nn.utils.clip_grad_norm_ on the reduced ones."""
        for b, g in zip(buckets, grads, strict=True):
            if b.reducer is not None:
                g.copy_(b.reducer.run({"g": g}).outputs["g"])
        norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        total = torch.linalg.vector_norm(norms)
        coef = torch.clamp(self.max_grad_norm / (total + _CLIP_EPS), max=1.0)
        for g in grads:
            g.mul_(coef)
        self.last_grad_norm = float(total)

    # -- state dicts ----------------------------------------------------------------------------
    def _whole(self, b: Bucket, name: str) -> torch.Tensor:
        """The whole tensor of state `name` (a collective when the executable keeps it sliced)."""
        if name in b.owned:
            return b.owned[name]
        if name in b.pending:
            return b.pending[name]
        return b.exe.gather_state(name)

    def state_dict(self) -> dict[str, Any]:
        """A torch-style state dict with whole (gathered) state per parameter, loadable at any world
        size; float32 master weights of bf16/fp16 parameters are saved as 'master_param'. Every rank
        must call it (gathering sliced state is a collective)."""
        saved = self.state
        self.state = type(saved)()
        try:
            out = super().state_dict()
        finally:
            self.state = saved
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for b in self._ensure_buckets():
            if b.step == 0:
                continue
            whole = {n: self._whole(b, n) for n in self.state_keys}
            master = self._whole(b, "w") if b.low_precision else None
            for i, p in enumerate(b.params):
                entry = {key: b.part(whole[n], i).reshape(p.shape).clone() for n, key in self.state_keys.items()}
                if self.has_step:
                    entry = {"step": torch.tensor(float(b.step))} | entry
                if master is not None:
                    entry["master_param"] = b.part(master, i).reshape(p.shape).clone()
                out["state"][index[id(p)]] = entry
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved at any world size (or by the torch optimizer of the same name): the
        hyperparameters of every group, and the state, resliced for this world size."""
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = state_dict.get("state", {})
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        for b in self._ensure_buckets():
            entries = [saved.get(index[id(p)], saved.get(str(index[id(p)]))) for p in b.params]
            if any((e is None) != (entries[0] is None) for e in entries):
                raise OptimizerError(f"{type(self).__name__}.load_state_dict: the state dict has state for only some "
                                     f"parameters of group {b.group}")
            if entries[0] is None:
                b.step = 0
                self._reset_state(b, {}, b.gather(b.params))
                continue
            try:
                state = {n: b.gather(e[key] for e in entries) for n, key in self.state_keys.items()}
            except (KeyError, RuntimeError) as exc:
                raise OptimizerError(f"{type(self).__name__}.load_state_dict: the state of group {b.group} does not "
                                     f"match its parameters ({exc})") from None
            b.step = int(entries[0]["step"]) if self.has_step else 1
            masters = [e.get("master_param", p) for e, p in zip(entries, b.params, strict=True)]
            self._reset_state(b, state, b.gather(masters))
