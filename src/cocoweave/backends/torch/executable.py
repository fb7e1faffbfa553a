"""One rank's compiled schedule: the generated step function (cached on disk, readable), its
buffers, its process groups and the state it keeps sliced between calls."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Generator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from ... import faults, settings
from ...errors import BackendError, InputError
from ...ir.graph import Program, make_layout
from ...ir.layout import Replicated, cut, part_bounds, part_shape, placements
from ...ir.semantics import Place, dropout_index
from ...ir.types import DTYPES, bind_shape
from ...plan import Collective, FusedCollective, Memory, Plan
from ...storage.codecache import write_source
from .. import inputs as _inputs
from ..inputs import RankInputs, bound_sizes, check_rank_inputs, local_shape
from ..results import RankResult
from . import shm
from .agreement import agree
from .codegen import generate
from .runtime import RankContext

_GROUPS: dict[tuple[int, ...], Any] = {}
_SIGNATURES = 8  # input signatures an executable remembers as checked
# How fused computation stages run: "auto" (CUDA: generated Triton kernels, the rest compiled; CPU: compiled),
# "triton" (generated Triton kernels where a stage has one, else torch ops), "compiled" (torch.compile: one loop
# per stage, Inductor's C++ on CPU), "torch" (torch ops one by one).
KERNELS = ("auto", "triton", "compiled", "torch")
KERNELS_ENV = settings.KERNELS.name  # the default route of every executable (e.g. "torch" where no C++ compiler is)


def default_kernels() -> str:
    """The route fused stages take unless an executable is told otherwise: $COCOWEAVE_KERNELS, else "auto"."""
    return settings.KERNELS.get()


def process_groups(program: Program, world_size: int, rank: int = 0) -> dict[str, Any]:
    """torch.distributed groups of the program's stages, and on a mesh, for each axis, the line of ranks along it
    through `rank` (keyed by the axis name). Every rank creates every group, in the same order (new_group is
    collective); groups are shared by all executables of a process."""
    mesh = program.groups[0].mesh
    if mesh is not None and len(mesh.axes) > 1:
        out: dict[str, Any] = {program.groups[0].name: None}
        for axis in mesh.axes:
            for line in program.groups[0].lines(world_size, axis):
                ranks = tuple(line)
                if ranks not in _GROUPS:
                    _GROUPS[ranks] = dist.new_group(list(ranks))
                if rank in ranks:
                    out[axis] = _GROUPS[ranks]
        return out
    if len(program.groups) == 1:
        return {program.groups[0].name: None}
    out = {}
    for g in program.groups:
        ranks = tuple(g.ranks(world_size))
        if ranks not in _GROUPS:
            _GROUPS[ranks] = dist.new_group(list(ranks))
        out[g.name] = _GROUPS[ranks]
    return out


class Executable:
    """Runs one rank's part of a plan inside an initialised torch.distributed process group."""

    def __init__(self, plan: Plan, rank: int, world_size: int, sizes: Mapping[str, int] | None = None,
                 device: str | torch.device = "cpu", kernels: str | None = None, group: Any = None):
        """`group`: a torch.distributed process group that plays the program's world (e.g. the data-parallel
        group of a data x tensor parallel grid); `rank` and `world_size` are then this rank's place in it."""
        self.plan, self.rank, self.world_size = plan, rank, world_size
        mesh = plan.program.groups[0].mesh
        if group is not None and (len(plan.program.groups) > 1 or (mesh is not None and len(mesh.axes) > 1)):
            raise BackendError(f"program `{plan.program.name}` splits its world into process groups or a mesh; it "
                               "cannot run on a given group (pass group=None)")
        self.program = plan.program
        self.sizes = bound_sizes(self.program, sizes)
        self.device = torch.device(device)
        self.program.check_world(world_size)
        kernels = kernels or default_kernels()
        fused = self._fused_kernels(kernels)
        memory = Memory.of(plan, plan.view(rank, world_size, self.sizes))
        self.source = generate(plan, rank, world_size, self.sizes, fused, memory)
        self._output_buffers = memory.output_buffers  # the buffers `release` looks at (by value name), and those
        self._output_views = memory.output_views  # an output may share storage with without being the buffer
        key = hashlib.sha256(json.dumps([plan.fingerprint, rank, world_size, self.sizes, sorted(fused)]).encode())
        key = key.hexdigest()[:16]
        self.path = write_source(self.source, f"{plan.fingerprint}-r{rank}-w{world_size}-{key}")
        namespace: dict[str, Any] = {}
        exec(compile(self.source, str(self.path or "<cocoweave step>"), "exec"), namespace)  # noqa: S102
        self._step, self._launch = namespace["step"], namespace["launch"]
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        if world_size > 1 and not dist.is_initialized():
            raise BackendError(f"rank {rank}: torch.distributed is not initialised; start ranks with "
                               "`cocoweave run --backend torch` or torchrun, or call cocoweave.launch.init_from_env()")
        if world_size > 1:  # before any other collective: ranks running different plans fail here, at once
            agree(f"{plan.fingerprint} {json.dumps(self.sizes, sort_keys=True)}",
                  "the plan to run (fingerprint and sizes)", group,
                  {"program": self.program.name, "program's fingerprint": self.program.fingerprint(),
                   "schedule": plan.name, "sizes": json.dumps(self.sizes, sort_keys=True),
                   "stages": " | ".join(map(str, plan.stages))})
        if group is not None:
            groups = {self.program.groups[0].name: group}
        elif world_size > 1:
            groups = process_groups(self.program, world_size, rank)
        else:
            groups = {g.name: None for g in self.program.groups}
        compiled = kernels == "compiled" or kernels == "auto"
        self.ctx = RankContext(rank, world_size, groups, self.device, self._dropout_indices(), backend, compiled)
        self.ctx.kernels = dict(fused)
        self._kept: dict[str, torch.Tensor] = {}  # state the schedule stores sliced, between calls
        self._checked: set[tuple] = set()  # input signatures `check_rank_inputs` accepted (see `_check`)

    def _fused_kernels(self, kernels: str) -> dict[int, Any]:
        """Generated Triton kernels for fused computation stages: on CUDA by default ("auto"), on any
        device with "triton" (CPU runs them under TRITON_INTERPRET=1), never with "torch" or "compiled"."""
        if kernels not in KERNELS:
            raise BackendError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {kernels!r}")
        if kernels in ("torch", "compiled") or (kernels == "auto" and self.device.type != "cuda"):
            return {}
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendError(f"rank {self.rank}: kernels='triton' on {self.device.type} needs TRITON_INTERPRET=1 "
                               "set before triton is imported; use kernels='torch' or a CUDA device")
        try:
            from ...kernels.codegen import build_fused_kernels
        except ImportError:  # Triton is not installed: torch ops compute every stage, unless Triton was asked for
            if kernels == "triton":
                raise BackendError(f"rank {self.rank}: kernels='triton' needs the triton package; "
                                   "install cocoweave[triton] or use kernels='torch'") from None
            return {}
        return build_fused_kernels(self.plan, self.rank, self.world_size, self.sizes, self.device)

    def kernel_sources(self) -> dict[int, str]:
        """Source of each generated Triton kernel, by stage index (empty when every stage runs torch ops)."""
        return {i: k.source for i, k in sorted(self.ctx.kernels.items())}

    def _dropout_indices(self) -> dict[str, torch.Tensor]:
        out = {}
        for v in self.program.values:
            if v.op == "dropout" and self.rank in v.group.ranks(self.world_size):
                place = Place(v.position(self.rank, self.world_size), self.sizes)
                shape = local_shape(v, self.sizes, place.pos)
                out[v.name] = dropout_index(v, shape, place, self.device)
        return out

    def _prepare(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's inputs in the plan's layouts: sliced state is sliced (when given whole) and
        kept; state not given continues from what was kept."""
        given = dict(inputs)
        for name in self.plan.sliced_state:
            v = self.program.inputs[name]
            if self.rank not in v.group.ranks(self.world_size):
                continue
            if name in given:
                self._keep(name, given.pop(name), copy=True)
            if name not in self._kept:
                raise InputError(f"rank {self.rank}: state `{name}` was never given; pass it on the first call")
            given[name] = self._kept[name]
        self._check(given)
        return given

    def _check(self, given: Mapping[str, Any]) -> None:
        """`check_rank_inputs`, once per input signature (names, shapes, dtypes, devices, scalar types): what it checks
        is all in the signature, so a repeated one passes again; with finite checks on (values) it runs every call."""
        if _inputs.CHECK_FINITE:
            check_rank_inputs(self.program, self.rank, self.world_size, given, self.sizes)
            return
        sig = tuple((k, t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (k, type(t))
                    for k, t in given.items())
        if sig in self._checked:
            return
        check_rank_inputs(self.program, self.rank, self.world_size, given, self.sizes, check_finite=False)
        if len(self._checked) >= _SIGNATURES:
            self._checked.clear()
        self._checked.add(sig)

    def _keep(self, name: str, t: Any, copy: bool) -> None:
        """Keep state `name` (sliced by the plan) from `t`: this rank's slice of it, or the tensor as the program
        writes it (e.g. whole), whose slice is cut out. With `copy`, what is kept is a copy (the caller keeps `t`)."""
        v = self.program.inputs[name]
        full, pos = bind_shape(v.shape, self.sizes), v.position(self.rank, self.world_size)
        have = part_bounds(self.plan.unsliced.get(name, Replicated), full, pos)  # its part as written
        if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(b - a for a, b in have):
            cut_ = cut(t, have, part_bounds(v.layout, full, pos))
            copy = copy or cut_.numel() != t.numel()  # a slice of a larger tensor: keep only the slice
            t = cut_
        self._kept[name] = t.clone() if copy and isinstance(t, torch.Tensor) else t

    @property
    def kept(self) -> Mapping[str, torch.Tensor]:
        """This rank's part of each state the schedule keeps sliced, by input name (read-only: `adopt` and
        `state_part` are the ways in)."""
        return MappingProxyType(self._kept)

    def state_part(self, name: str) -> torch.Tensor:
        """This rank's part of state `name` (kept sliced by the plan), to read or to load in place (a checkpoint):
        allocated uninitialised when it was never given, so that the next `run` continues from what is loaded."""
        part = self._kept.get(name)
        if part is None:
            v = self.program.inputs[name]
            part = self._kept[name] = torch.empty(self.local_shape(name), dtype=DTYPES[v.dtype], device=self.device)
        return part

    def adopt(self, name: str, t: torch.Tensor) -> None:
        """Hand state `name` (sliced by the plan) to the executable, which keeps it from now on: `t` is this rank's
        slice (kept as it is, no copy: the caller must not use it afterwards) or the whole tensor (its slice is
        copied out). Saves the copy a first `run` makes of state given as an input."""
        self._keep(name, t, copy=False)

    def run(self, inputs: RankInputs, defer_gathers: bool = False) -> RankResult:
        """One step. State tensors are updated in place (sliced ones are kept by the executable);
        returned outputs are the executable's buffers, valid until the next call. With `defer_gathers`, the
        all-gathers that write a state tensor nothing later reads are left in flight: call `wait()` before
        reading those state tensors (an optimizer overlaps them with the next forward)."""
        steps = self.steps(inputs, defer_gathers)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    __call__ = run

    def steps(self, inputs: RankInputs, defer_gathers: bool = False) -> Generator[tuple[int, dict], None, RankResult]:
        """One step as a generator that pauses before each stage, yielding (stage index, the tensors the stage
        reads by value name), and returns the RankResult: a caller can work between stages, e.g. `provide` the
        result of a collective from values of several executables (one global norm over many buckets)."""
        self.wait()
        given = self._prepare(inputs)
        self.ctx.defer = defer_gathers
        step = self._step(self.ctx, given)
        try:
            outputs = yield from (self._ranges(step) if torch.autograd._profiler_enabled() else step)
        finally:
            self.ctx.defer = False
        if faults.ACTIVE:  # past its last stage: a rank that dies later (a pipeline's send) is at no stage of it
            faults.reset_stage()
        state = {n: given[n] for n in self.plan.state if n in given}
        return RankResult(outputs=outputs, state=state)

    def _ranges(self, step: Generator[tuple[int, dict], Any, Any]) -> Generator[tuple[int, dict], Any, Any]:
        """`step` with each stage in a `record_function` range named `cocoweave I:LABEL`, while a profiler runs: the
        stages show up in torch.profiler's trace, and in Nsight Systems under torch.autograd.profiler.emit_nvtx."""
        try:
            item = next(step)
            while True:
                sent = yield item
                with torch.profiler.record_function(f"cocoweave {item[0]}:{self.plan.stages[item[0]].label}"):
                    item = step.send(sent)  # runs stage item[0], up to the next stage's yield
        except StopIteration as done:
            return done.value
        finally:
            step.close()

    def launch(self, inputs: RankInputs) -> bool:
        """Issue the step's first collective now, asynchronously (a gradient reduction from a backward hook, while
        backward goes on); the next `run` takes its result. False when the plan does not open with one (a shared
        memory or ring algorithm, a computation first): the run does all the work."""
        if self._launch is None:
            return False
        self._launch(self.ctx, inputs)
        return True

    def release(self, t: torch.Tensor) -> torch.Tensor:
        """Hand output `t` of the last step to the caller for good (an activation autograd keeps): the buffer it
        lives in is dropped, the next step allocates another; a result in shared memory is copied out. Only the
        buffers the Plan says an output may be (Memory.output_buffers) are looked at: most outputs are new tensors."""
        buffers = self.ctx.buffers
        for name in self._output_buffers:
            if buffers.get(name) is t:  # the collective's buffer itself
                del buffers[name]
                return t
        if not self._output_views:
            return t
        shm_ = self.ctx.shm_buffers
        for name in self._output_views:
            b = buffers.get(name)
            if b is not None and shm.shares(t, (b,)):
                del buffers[name]
                return t
            for slots in (shm_.slots.get(name), shm_.slots.get((name, "whole")), shm_.commons.get((name, "whole"))):
                if slots and shm.shares(t, slots):
                    return t.clone()
        return t

    def provide(self, value: str, result: torch.Tensor) -> None:
        """Give the result of collective `value` (by value name) for the coming or paused step: it does not
        communicate, it returns `result`."""
        self.ctx.provided[value] = result

    def shared_input(self, name: str) -> torch.Tensor | None:
        """Where to put input `name` so that a shared-memory collective works on it without copies: for the operand of
        the step's opening shm reduce-scatter or all-reduce, this rank's slot of it (a gradient bucket can live there,
        filled by backward); for a state tensor an shm all-gather fills whole (an optimizer's parameters), one tensor
        all ranks of the group map when the step opens with a shared-memory collective of that group (whose barrier
        orders every read of the old whole before any rank writes its new part: the all-gather is then a barrier,
        the tensor stored once per host), else a whole-size slot of its own the other ranks read this rank's part
        from. None when neither applies on this host, and off the CPU (a CUDA parameter stays in device memory)."""
        if self.world_size == 1 or self.ctx.device.type != "cpu":
            return None
        view = self.plan.view(self.rank, self.world_size, self.sizes)
        stage = next((s for s in self.plan.stages if view.takes_part(s)), None)
        head = stage.values[0] if isinstance(stage, Collective | FusedCollective) else None
        opening = self._shm_group(head) if head is not None and stage.algorithm == "shm" else None
        if opening is not None and head.op in ("all_reduce", "reduce_scatter") and head.args[0].name == name and \
                head.args[0].op == "input":
            x, g, key, common = head.args[0], opening, head.name, False
            if (x.dtype in ("float16", "bfloat16") and self.ctx.backend == "gloo") or \
                    (head.op == "reduce_scatter" and head.attrs["dim"] != 0):  # a copy is made anyway
                return None
        else:
            new = self.plan.state.get(name)
            at = next((s for s in self.plan.stages if new is not None and any(v is new for v in s.values)), None)
            if new is None or new.op != "all_gather" or getattr(at, "algorithm", "") != "shm" or \
                    new.attrs["dim"] != 0 or view.local_shape(new) != view.local_shape(self.program.inputs[name]):
                return None
            x, g = self.program.inputs[name], self._shm_group(new)
            key, common = (new.name, "whole"), g is not None and opening is g
        if g is None:
            return None
        shape = view.local_shape(x)
        numel = math.prod(shape)
        try:
            slots = self.ctx.shm_buffers.get(g, key, numel, DTYPES[x.dtype], common)
        except shm.ShmUnavailable:  # every rank of the group sees it: the collective copies (or runs as the library's)
            return None
        shm.lend(slots)  # the caller computes into it: its collectives end with a barrier
        return slots[0 if common else g.me][:numel].view(shape)

    def _shm_group(self, collective: Any) -> shm.ShmGroup | None:
        """The shared-memory group a collective value runs over (on a mesh: the line of its axis through this
        rank), or None where its ranks do not share this host."""
        return shm.group_for(self.ctx.group(collective.attrs.get("axis") or collective.group.name))

    def wait(self) -> None:
        """Complete the all-gathers a deferred step left in flight (their state tensors are then final)."""
        self.ctx.wait_deferred()

    def cancel(self) -> None:
        """Complete and drop a collective launched ahead of a step that will not run (its result is stale)."""
        self.ctx.drop_early()

    def local_shape(self, name: str) -> tuple[int, ...]:
        """The shape of this rank's part of input `name` in the plan's layouts (a state kept sliced: its slice)."""
        v = self.program.inputs[name]
        return self.plan.view(self.rank, self.world_size, self.sizes).local_shape(v)

    def gather_state(self, name: str) -> torch.Tensor:
        """The whole tensor of state kept sliced (a collective: every rank of its group calls it); on a mesh,
        gathered along every axis that slices it, the innermost first."""
        v = self.program.inputs[name]
        part = self._kept[name]
        full, pos = bind_shape(v.shape, self.sizes), v.position(self.rank, self.world_size)
        axes = v.group.axes
        per = list(placements(v.layout, len(axes)))
        for i in reversed(range(len(axes))):
            p = per[i]
            if not p.is_sliced:
                continue
            per[i] = Replicated
            total = part_shape(make_layout(v.group, per), full, pos)[p.dim]
            group = self.ctx.group(axes[i] if axes[i] is not None else v.group.name)
            part = self.ctx.all_gather(part, p.dim, total, group, out=("gather_state", name, i), shares=p.shares)
        return part.clone()

    # -- what an optimizer reads of its program (cocoweave.optim's BucketProgram) ----------------
    @property
    def sliced_state(self) -> list[str]:
        """The state inputs this executable keeps sliced between calls (`adopt`, `gather_state`)."""
        return self.plan.sliced_state

    def tensor_inputs(self) -> dict[str, torch.dtype]:
        """The program's tensor inputs (its runtime scalars aside) and their torch dtypes, in program order."""
        return {v.name: DTYPES[v.dtype] for v in self.program.tensor_inputs}

    def stage_op(self, index: int) -> str:
        """The collective stage `index` runs (e.g. "reduce_scatter"), "" for a computation."""
        return getattr(self.plan.stages[index], "op", "")

    def stage_names(self, index: int) -> tuple[str, ...]:
        """The values stage `index` computes, by name (e.g. to pause a step before one)."""
        return tuple(self.plan.stages[index].names)

    def held_bytes(self) -> int:
        """Bytes this rank's executable keeps between calls: its buffers, dropout index and mask tensors and the
        shared-memory segments its collectives map (every rank's slots, and the set they alternate with), each
        storage once. What pre-flight's memory model (preflight.memory.program_bytes) is checked against."""
        ctx = self.ctx
        tensors = [*ctx.buffers.values(), *ctx.indices.values(), *ctx._masks.values()]
        for store in (ctx.shm_buffers.slots, ctx.shm_buffers.commons):
            for slots in store.values():
                tensors += [*slots, *(getattr(slots, "spare", None) or ())]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def trace(self, enabled: bool = True) -> None:
        self.ctx.tracing = enabled
