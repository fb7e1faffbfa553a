"""What generated step functions call: the rank's resources (buffers, process groups, shared-memory segments,
results launched early or provided, dropout indices and masks, trace spans), the chunk pipeline and the helpers
generated code calls inline. One `RankContext` per executable; buffers are allocated on first use and reused by
every later step. The collectives themselves are each algorithm's functions of a RankContext, registered against
the table of collective algorithms (library.py, ring_algorithm.py, shm_algorithm.py; backends/torch/algorithms.py):
generated code calls them through the context by name (`ctx.all_reduce(...)`).
"""

from __future__ import annotations

import time
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ... import collectives, faults, rng
from ...ir.semantics import grouped_matmul, grouped_matmul_wgrad, reduce_local, silu_grad  # noqa: F401 - rt.*
from . import shm
from .ring import with_dim  # noqa: F401 - generated code calls rt.with_dim

_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
KERNELS_HINT = "COCOWEAVE_KERNELS=torch (op by op) or =compiled"
# torch 2.13 renamed the tensor collectives; older releases (the GPU machine's 2.11) have the old names (the library
# algorithm calls them through this module: a test counting collectives wraps them here)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NAMED: list[Any] = [None, {}]  # (collectives.generation(), the torch backend's implementations by name) it was read at


def _implementations() -> dict[str, Callable[..., Any]]:
    """The torch backend's registered collective implementations by name, read again only when the tables change."""
    if _NAMED[0] != collectives.generation():
        _NAMED[:] = [collectives.generation(), collectives.implementations("torch")]
    return _NAMED[1]


# -- helpers used inline by generated code ----------------------------------------------------
def dropout_key(seed: int, rank: int) -> int:
    return rng.dropout_key(int(seed), rank)


def apply_dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Zero the dropped elements of x and scale the kept ones by 1 / (1 - p)."""
    if p == 0.0:
        return x
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


def dropout(x: torch.Tensor, index: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """Counter-based dropout on precomputed logical indices (a seed known only at run time)."""
    return x if p == 0.0 else apply_dropout(x, rng.keep_mask(index, key, rng.keep_threshold(p)), p)


def reduce(op: str, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    return reduce_local(op, x, dims, keepdim)


def maximum(a: Any, b: Any) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        a, b = b, a
    return torch.clamp(a, min=b) if not isinstance(b, torch.Tensor) else torch.maximum(a, b)


def minimum(a: Any, b: Any) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        a, b = b, a
    return torch.clamp(a, max=b) if not isinstance(b, torch.Tensor) else torch.minimum(a, b)


def concat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(list(parts), dim=dim)


def logical_index(full: Sequence[int], local: Sequence[int], dim: int | Sequence[int] | None,
                  start: int | Sequence[int], device: torch.device) -> torch.Tensor:
    """Row-major indices in a tensor of shape `full` of the elements of its part of shape `local` that starts at
    `start` along `dim` (None: the whole tensor), as a sum of broadcast aranges: inside a compiled stage this is
    index arithmetic in the loop, no tensor in memory (cocoweave.rng.logical_index, narrowed, gives the same)."""
    nd = len(full)
    dims = () if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    offsets = dict(zip(dims, (start,) if isinstance(start, int) else tuple(start)))  # a part cut on several dims
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in range(nd - 1, -1, -1):
        part = torch.arange(local[d], dtype=torch.int64, device=device) + offsets.get(d, 0)
        index = index + (part * stride).view([local[d] if j == d else 1 for j in range(nd)])
        stride *= full[d]
    return index


class CompiledStage:
    """A fused stage's function run as one loop: torch.compile (Inductor: C++ on CPU, Triton on CUDA), compiled
    on the first call. Python numbers (learning rate, step, dropout keys) are passed as 0-dim tensors kept here,
    so that a new value each step does not recompile. Stages of the same code called on tensors of the same shapes
    (an optimizer's buckets of one size, each its own executable) share one compilation: the compiler's work and
    memory are paid once per process, not once per bucket."""

    def __init__(self, fn: Callable[..., Any]):
        self.name, self.eager = fn.__name__, fn
        self.fn: Callable[..., Any] | None = None  # the compiled function, found or made on the first call
        self.failed = False  # it could not be compiled: the ops run one by one
        self.numbers: dict[int, torch.Tensor] = {}

    def __call__(self, *args: Any) -> Any:
        if self.failed or _get_current_dispatch_mode() is not None:
            # a dispatch mode watching the ops (a FLOP counter, `cocoweave profile`'s counted step) sees them one by
            # one: torch.compile refuses to run under one
            return self.eager(*args)
        call = []
        for i, a in enumerate(args):
            if isinstance(a, bool | int | float):
                dtype = torch.bool if isinstance(a, bool) else torch.int64 if isinstance(a, int) else torch.float64
                t = self.numbers.get(i)
                if t is None or t.dtype != dtype:
                    t = self.numbers[i] = torch.empty((), dtype=dtype)
                t.fill_(a)
                a = t
            call.append(a)
        if self.fn is not None:
            return self.fn(*call)
        key = _stage_key(self.eager, call)
        shared = _COMPILED.get(key)
        if shared is not None:
            self.fn = shared
            return shared(*call)
        import torch._inductor.config as inductor

        fn = torch.compile(self.eager, fullgraph=True, dynamic=False)
        try:  # the first call compiles; a machine without a working C++ compiler runs the ops one by one
            # ranks share the machine's cores: no pool of compile workers per rank, for this compilation only (the
            # user's own torch.compile keeps its setting)
            with inductor.patch(compile_threads=1):
                out = fn(*call)
        except Exception as exc:  # noqa: BLE001 - torch.compile raises many types; the stage still runs
            warnings.warn(f"fused stage {self.name} could not be compiled ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}); it runs op by op. "
                          f"Set {KERNELS_HINT} to choose the route.", RuntimeWarning, stacklevel=2)
            self.failed = True
            return self.eager(*args)
        self.fn = _COMPILED[key] = fn
        return out


# compiled stage functions by code and argument shapes, while a CompiledStage holds them
_COMPILED: weakref.WeakValueDictionary[tuple, Callable[..., Any]] = weakref.WeakValueDictionary()


def _stage_key(fn: Callable[..., Any], args: Sequence[Any]) -> tuple:
    """What decides a compiled stage: its code (constants included), and its tensors' shapes, strides, dtypes and
    devices (numbers arrive as 0-dim tensors)."""
    code = fn.__code__
    return (code.co_code, code.co_consts, code.co_names, code.co_varnames,
            tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a)
                  for a in args))


class Pending:
    """An asynchronous collective: `wait()` completes it and returns its result."""

    def __init__(self, work: Any, finish: Callable[[], Any]):
        self.work, self.finish = work, finish

    def wait(self) -> Any:
        if self.work is not None:
            self.work.wait()
        return self.finish()


class RankContext:
    """One rank's resources for one executable: process groups, buffers, shared-memory segments, collectives
    launched early or provided, dropout indices, trace. Collective implementations registered for the torch backend
    are reached through it by name."""

    def __init__(self, rank: int, world_size: int, groups: dict[str, Any], device: torch.device,
                 indices: dict[str, torch.Tensor], backend: str, compiled: bool = False):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.compiled = compiled  # fused stages run as one compiled loop (else op by op)
        self._stages: dict[str, Callable[..., Any]] = {}
        self.shm_buffers = shm.ShmBuffers()  # slots of the shared-memory collectives, by output key
        self._early: dict[Any, Pending] = {}  # collectives launched ahead of the step (Executable.launch)
        self.provided: dict[Any, torch.Tensor] = {}  # results the caller gives for collectives (Executable.provide)
        self.defer = False  # leave deferrable all-gathers in flight when the step returns (Executable.run)
        self.deferred: list[Pending] = []
        self.pairs: dict[Any, shm.Pair | None] = {}  # shared-memory point-to-point pairs, by output key
        self.groups, self.indices, self.backend = groups, indices, backend
        self.buffers: dict[Any, torch.Tensor] = {}
        self._masks: dict[tuple[str, int], torch.Tensor] = {}  # dropout masks of constant seeds
        self.events: list[tuple[str, str, int, int, int | None]] = []
        self.tracing = False
        self.kernels: dict[int, Any] = {}  # stage index -> generated Triton kernel (kernels.codegen)

    def __getattr__(self, name: str) -> Any:
        """A collective implementation registered for the torch backend as a function (collectives.implement, with a
        name not starting with "_"), bound to this context: generated code calls it by name like the methods here."""
        fn = None if name.startswith("_") else _implementations().get(name)
        if fn is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return types.MethodType(fn, self)

    # -- resources ----------------------------------------------------------------------------
    def group(self, name: str) -> Any:
        return self.groups[name]

    def fused(self, stage: int) -> Any:
        return self.kernels[stage]

    def stage(self, index: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        """How fused stage `fn` runs: compiled into one loop (CompiledStage), or its torch ops one by one."""
        f = self._stages.get(fn.__name__)
        if f is None:
            f = self._stages[fn.__name__] = CompiledStage(fn) if self.compiled else fn
        return f

    def index(self, name: str) -> torch.Tensor:
        return self.indices[name]

    def keep(self, name: str, p: float, key: int) -> torch.Tensor:
        """The keep mask of dropout `name` for a seed that is a program constant: the same every step (it
        depends only on the seed, the logical index and the rank), so it is hashed once and kept."""
        mask = self._masks.get((name, key))
        if mask is None:
            mask = self._masks[(name, key)] = rng.keep_mask(self.indices[name], key, rng.keep_threshold(p))
        return mask

    def buffer(self, key: Any, shape: Sequence[int], dtype: torch.dtype,
               device: torch.device | None = None) -> torch.Tensor:
        """A tensor owned by this executable (on its device unless `device`), allocated on first use and reused by
        later steps."""
        shape = tuple(shape)
        b = self.buffers.get(key)
        if b is None or tuple(b.shape) != shape or b.dtype != dtype:
            b = self.buffers[key] = torch.empty(shape, dtype=dtype, device=device or self.device)
        return b

    @contextmanager
    def span(self, label: str, stage: int, stream: str = "compute", chunk: int | None = None):
        if faults.ACTIVE and chunk is None:  # fault injection / stage progress (cocoweave.faults)
            faults.enter(self.rank, stage, label)
        if not self.tracing:
            yield
            return
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            name = label if chunk is not None else f"{stage}:{label}"  # chunk parts: the part's label
            self.events.append((name, stream, t0, time.perf_counter_ns(), chunk))

    # -- collectives --------------------------------------------------------------------------
    def wire(self, x: torch.Tensor) -> torch.Tensor:
        """Gloo reduces half types in half; accumulate in float32 like the reference does."""
        return x.float() if self.backend == "gloo" and x.dtype in (torch.float16, torch.bfloat16) else x

    def done(self, work: Any, finish: Callable[[], Any], async_op: bool) -> Any:
        p = Pending(work, finish)
        return p if async_op else p.wait()

    def alone(self, x: torch.Tensor, out: Any, async_op: bool, into: torch.Tensor | None = None,
               group: Any = None) -> Any | None:
        """What a collective returns without communicating, or None: its result issued ahead of the step (launch),
        a result the caller provided, or, in a group of one rank (or a world of one without torch.distributed),
        this rank's own tensor (the identity; avg and adasum of one tensor are the tensor): no collective runs."""
        early = self._early.pop(out, None)
        if early is not None:
            return early if async_op else early.wait()
        if out in self.provided:
            res = self.provided.pop(out)
            return self.done(None, lambda: res, async_op)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            return None
        res = into if into is not None else self.buffer(out, x.shape, x.dtype)
        res.copy_(x)
        return self.done(None, lambda: res, async_op)

    def early(self, out: Any, issue: Callable[[], Pending]) -> None:
        """Issue a collective ahead of the step (generated `launch`) and keep it: the step's call of it returns it.
        Launched again before a step (gradient accumulation), the first completes before the second is issued
        (both write the same buffer) and only the second counts."""
        old = self._early.pop(out, None)
        if old is not None:
            old.wait()
        self._early[out] = issue()

    def drop_early(self) -> None:
        while self._early:
            self._early.pop(next(iter(self._early))).wait()

    def wait_deferred(self) -> None:
        """Complete the all-gathers a step left in flight."""
        while self.deferred:
            self.deferred.pop(0).wait()

    def _reduce_op(self, op: str, t: torch.Tensor) -> tuple[Any, bool]:
        """torch's reduction for `op` on tensor `t`, and whether the result must still be divided by the group size:
        NCCL averages floating-point tensors itself (ReduceOp.AVG, no separate division kernel); Gloo sums."""
        if op == "avg" and t.is_floating_point() and (self.backend == "nccl" or
                                                      (t.device.type == "cuda" and "cuda:nccl" in self.backend)):
            return dist.ReduceOp.AVG, False
        return _REDUCE[op], op == "avg"

    # -- the shared-memory algorithm (shm.py): synchronous, ranks of one host --------------------------------
    def _shm_group(self, group: Any, x: torch.Tensor) -> shm.ShmGroup | None:
        """The shared-memory group of `group` for operand `x`, or None (the library's collective then, with one
        warning): the memory is the host's, so only CPU tensors go through it, on ranks proven to share it."""
        if x.device.type != "cpu":
            self._shm_warn(f"its tensors are on {x.device.type}, not in the host's memory")
            return None
        g = shm.group_for(group)
        if g is None and not getattr(self, "_shm_warned", False) and dist.get_world_size(group) > 1:
            self._shm_warn(shm.why_not(group) or "the ranks of a group do not share this host's memory")
        return g

    def _shm_warn(self, why: str) -> None:
        if not getattr(self, "_shm_warned", False):
            self._shm_warned = True
            warnings.warn(f"rank {self.rank}: shm collectives run as the library's: {why}", RuntimeWarning,
                          stacklevel=4)

    def _shm_slots(self, g: shm.ShmGroup, out: Any, numel: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The slots of collective `out`, or None when no segment can be made for it (every rank of the group
        agrees, from the store): that collective then runs as the library's."""
        try:
            return self.shm_buffers.get(g, out, numel, dtype)
        except shm.ShmUnavailable as e:
            self._shm_warn(str(e))
            return None

    # -- overlap ------------------------------------------------------------------------------
    def pipeline(self, chunks: int, parts: Sequence[Callable[[int, dict], None]],
                 comm: Sequence[bool] | None = None, labels: Sequence[str] | None = None) -> list[dict]:
        """Run parts[j] on chunk k at time k + j: at each time the newest chunk computes while the
        collectives issued (asynchronously) for older chunks are in flight. A part waits only for
        the results it reads, just before it runs. `comm[j]` marks parts that issue communication.

        On CUDA a communication part is issued on a side stream (after it waits for the compute
        stream, which made its operand) and records an event there; the compute stream waits on
        that event only when a later part reads the result, so chunk k's collective overlaps chunk
        k+1's matmul. At the end the compute stream waits for the side stream: tensors the side
        stream read may then be freed and reused safely. (Written for GPUs, not run on one yet.)"""
        comm = list(comm) if comm is not None else [False] * len(parts)
        labels = list(labels) if labels is not None else [getattr(f, "__name__", f"part{j}") for j, f in
                                                          enumerate(parts)]
        side = self._side_stream() if self.device.type == "cuda" else None
        envs: list[dict] = [{} for _ in range(chunks)]
        inflight: list[list[tuple[str, int]]] = [[] for _ in range(chunks)]  # comm spans: (label, issued at)
        for t in range(chunks + len(parts) - 1):
            for j in range(len(parts) - 1, -1, -1):
                k = t - j
                if not 0 <= k < chunks:
                    continue
                self._resolve(envs[k], inflight[k], k)
                if comm[j]:
                    inflight[k].append((labels[j], time.perf_counter_ns()))
                    if side is None:
                        parts[j](k, envs[k])
                        continue
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side):
                        parts[j](k, envs[k])
                        done = torch.cuda.Event()
                        done.record(side)
                    envs[k][_EVENT] = done
                else:
                    with self.span(labels[j], j, "compute", k):
                        parts[j](k, envs[k])
        for k, env in enumerate(envs):
            self._resolve(env, inflight[k], k)
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
        return envs

    def _side_stream(self) -> Any:
        if getattr(self, "_comm_stream", None) is None:
            self._comm_stream = torch.cuda.Stream(self.device)
        return self._comm_stream

    def _resolve(self, env: dict, inflight: list[tuple[str, int]], chunk: int) -> None:
        """Complete the chunk's pending collectives (on CUDA, after the compute stream waits for the
        side stream's event); with tracing, each becomes a span on the `comm` track from issue to end."""
        event = env.pop(_EVENT, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        _resolve(env)
        if inflight and self.tracing:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            end = time.perf_counter_ns()
            self.events += [(label, "comm", start, end, chunk) for label, start in inflight]
        inflight.clear()


_EVENT = "__cuda_event__"  # env key of the event recorded after a chunk's communication was issued


def _resolve(env: dict) -> None:
    for key, val in list(env.items()):
        if isinstance(val, Pending):
            env[key] = val.wait()

