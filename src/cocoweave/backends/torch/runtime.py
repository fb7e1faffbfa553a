"""What generated step functions call: per-rank buffers, collectives, P2P, the chunk pipeline,
dropout and trace spans. One `RankContext` per executable; buffers are allocated on first use and
reused by every later step.

Uneven splits (torch.tensor_split sizes, or parts in proportion to `shares`) are handled by padding every
part to the largest one, so the library's equal-size reduce_scatter / all_gather apply; when the split is
even along dim 0 the tensors are used as they are, without copies.
"""

from __future__ import annotations

import math
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
from ...ir.layout import slice_bounds
from ...ir.semantics import reduce_local
from . import ring, shm
from .ring import parts, with_dim  # generated code calls rt.with_dim

_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
KERNELS_HINT = "COCOWEAVE_KERNELS=torch (op by op) or =compiled"
# torch 2.13 renamed the tensor collectives; older releases (the GPU machine's 2.11) have the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- helpers used inline by generated code ----------------------------------------------------
def dropout_key(seed: int, rank: int) -> int:
    return rng.dropout_key(int(seed), rank)


def keep_mask(index: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """Which elements dropout keeps: the counter-based hash (cocoweave.rng) of their logical indices."""
    return rng.triple32((index & rng.MASK32) ^ key) >= rng.keep_threshold(p)


def apply_dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Zero the dropped elements of x and scale the kept ones by 1 / (1 - p)."""
    if p == 0.0:
        return x
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


def dropout(x: torch.Tensor, index: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """Counter-based dropout on precomputed logical indices (a seed known only at run time)."""
    return x if p == 0.0 else apply_dropout(x, keep_mask(index, p, key), p)


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
    """One rank's runtime state for one executable: process groups, buffers, dropout indices, trace."""

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
        self._pairs: dict[Any, shm.Pair | None] = {}
        self.groups, self.indices, self.backend = groups, indices, backend
        self.buffers: dict[Any, torch.Tensor] = {}
        self._masks: dict[tuple[str, int], torch.Tensor] = {}  # dropout masks of constant seeds
        self.events: list[tuple[str, str, int, int, int | None]] = []
        self.tracing = False
        self.kernels: dict[int, Any] = {}  # stage index -> generated Triton kernel (kernels.codegen)

    def __getattr__(self, name: str) -> Any:
        """A collective implementation registered for the torch backend as a function (collectives.implement, with a
        name not starting with "_"), bound to this context: generated code calls it by name like the methods here."""
        fn = None if name.startswith("_") else collectives.implementations("torch").get(name)
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
            mask = self._masks[(name, key)] = keep_mask(self.indices[name], p, key)
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
    def _wire(self, x: torch.Tensor) -> torch.Tensor:
        """Gloo reduces half types in half; accumulate in float32 like the reference does."""
        return x.float() if self.backend == "gloo" and x.dtype in (torch.float16, torch.bfloat16) else x

    def _done(self, work: Any, finish: Callable[[], Any], async_op: bool) -> Any:
        p = Pending(work, finish)
        return p if async_op else p.wait()

    def _alone(self, x: torch.Tensor, out: Any, async_op: bool, into: torch.Tensor | None = None,
               group: Any = None) -> Any | None:
        """What a collective returns without communicating, or None: its result issued ahead of the step (launch),
        a result the caller provided, or, in a group of one rank (or a world of one without torch.distributed),
        this rank's own tensor (the identity; avg and adasum of one tensor are the tensor): no collective runs."""
        early = self._early.pop(out, None)
        if early is not None:
            return early if async_op else early.wait()
        if out in self.provided:
            res = self.provided.pop(out)
            return self._done(None, lambda: res, async_op)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            return None
        res = into if into is not None else self.buffer(out, x.shape, x.dtype)
        res.copy_(x)
        return self._done(None, lambda: res, async_op)

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

    def all_reduce(self, x: torch.Tensor, op: str, group: Any, out: Any, async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op, group=group)) is not None:
            return alone
        n = dist.get_world_size(group)
        if op == "adasum":  # synchronous: point-to-point rounds
            res = self._adasum(x, group, out)
            return self._done(None, lambda: res, async_op)
        wire = self._wire(x)
        key = (out, "wire") if wire is not x else out
        buf = self.buffer(key, wire.shape, wire.dtype)
        buf.copy_(wire)
        reduce_op, divide = self._reduce_op(op, buf)
        work = dist.all_reduce(buf, reduce_op, group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            if divide:
                buf.div_(n)
            if buf.dtype == x.dtype:
                return buf
            res = self.buffer(out, x.shape, x.dtype)
            res.copy_(buf)
            return res

        return self._done(work if async_op else None, finish, async_op)

    def _reduce_op(self, op: str, t: torch.Tensor) -> tuple[Any, bool]:
        """torch's reduction for `op` on tensor `t`, and whether the result must still be divided by the group size:
        NCCL averages floating-point tensors itself (ReduceOp.AVG, no separate division kernel); Gloo sums."""
        if op == "avg" and t.is_floating_point() and (self.backend == "nccl" or
                                                      (t.device.type == "cuda" and "cuda:nccl" in self.backend)):
            return dist.ReduceOp.AVG, False
        return _REDUCE[op], op == "avg"

    def _adasum(self, x: torch.Tensor, group: Any, out: Any) -> torch.Tensor:
        """Adasum by vector-halving, distance-doubling over P2P (backends/torch/adasum.py): bandwidth
        like a ring all-reduce, combining in exactly the reference's order on any group size."""
        from .adasum import adasum_all_reduce

        return adasum_all_reduce(x, group, self.buffer(out, x.shape, x.dtype))

    def reduce_scatter(self, x: torch.Tensor, op: str, dim: int, group: Any, out: Any,
                       async_op: bool = False, shares: Sequence[int] | None = None) -> Any:
        if (alone := self._alone(x, out, async_op, group=group)) is not None:
            return alone
        n, me = dist.get_world_size(group), dist.get_rank(group)
        size = x.shape[dim]
        bounds = parts(size, n, shares)
        c = max(stop - start for start, stop in bounds)
        wire = self._wire(x).movedim(dim, 0)
        rest = tuple(wire.shape[1:])
        mine = bounds[me][1] - bounds[me][0]
        if shares is not None and self.backend == "gloo":  # Gloo reduces uneven parts as they are: no padding
            part = self.buffer((out, "part"), (mine, *rest), wire.dtype)
            pieces = [wire[start:stop].contiguous() for start, stop in bounds]
            work = dist.reduce_scatter(part, pieces, op=_REDUCE[op], group=group, async_op=async_op)
            return self._done(work if async_op else None, self._scattered(x, dim, mine, part, op, n, out), async_op)
        if size % n == 0 and dim == 0 and wire.is_contiguous() and shares is None:
            inp = wire
        else:  # pad each rank's segment to c rows so that equal-size reduce_scatter applies
            inp = self.buffer((out, "in"), (c * n, *rest), wire.dtype)
            for r, (start, stop) in enumerate(bounds):
                inp[r * c:r * c + stop - start].copy_(wire[start:stop])
        part = self.buffer((out, "part"), (c, *rest), wire.dtype)
        reduce_op, divide = self._reduce_op(op, part)
        work = _REDUCE_SCATTER(part, inp, op=reduce_op, group=group, async_op=async_op)

        return self._done(work if async_op else None,
                          self._scattered(x, dim, mine, part, "avg" if divide else "sum", n, out), async_op)

    def _scattered(self, x: torch.Tensor, dim: int, mine: int, part: torch.Tensor, op: str, n: int,
                   out: Any) -> Callable[[], torch.Tensor]:
        """What completes a reduce_scatter: this rank's `mine` rows of `part` into its buffer, averaged for avg."""

        def finish() -> torch.Tensor:
            res = self.buffer(out, with_dim(x.shape, dim, mine), x.dtype)
            res.movedim(dim, 0).copy_(part[:mine])
            if op == "avg":
                res.div_(n)
            return res

        return finish

    def all_gather(self, x: torch.Tensor, dim: int, total: int, group: Any, out: Any, async_op: bool = False,
                   into: torch.Tensor | None = None, deferrable: bool = False,
                   shares: Sequence[int] | None = None) -> Any:
        """Gather the ranks' parts (tensor_split sizes, or in proportion to `shares`) of a tensor whose whole size
        along `dim` is `total` (into `into`, when given: a state tensor the result becomes). A deferrable gather is
        left in flight while the executable defers (its result is only read after Executable.wait)."""
        if (alone := self._alone(x, out, async_op, into, group)) is not None:
            return alone
        if deferrable and self.defer and not async_op:
            self.deferred.append(self.all_gather(x, dim, total, group, out, True, into, shares=shares))
            return into
        n = dist.get_world_size(group)
        bounds = parts(total, n, shares)
        sizes = [stop - start for start, stop in bounds]
        c = max(sizes)
        xt = x.movedim(dim, 0)
        rest = tuple(xt.shape[1:])
        full_shape = with_dim(x.shape, dim, total)
        res = into if into is not None else self.buffer(out, full_shape, x.dtype)
        if total % n == 0 and dim == 0 and x.is_contiguous() and res.is_contiguous() and shares is None:
            work = _ALL_GATHER(res, x, group=group, async_op=async_op)
            return self._done(work if async_op else None, lambda: res, async_op)
        inp = self.buffer((out, "in"), (c, *rest), x.dtype)
        inp[:xt.shape[0]].copy_(xt)
        gathered = self.buffer((out, "gathered"), (c * n, *rest), x.dtype)
        work = _ALL_GATHER(gathered, inp, group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            rt = res.movedim(dim, 0)
            for r, (start, stop) in enumerate(bounds):
                rt[start:stop].copy_(gathered[r * c:r * c + stop - start])
            return res

        return self._done(work if async_op else None, finish, async_op)

    def all_to_all(self, x: torch.Tensor, src_dim: int, dim: int, total: int, group: Any, out: Any,
                   async_op: bool = False, src_shares: Sequence[int] | None = None,
                   shares: Sequence[int] | None = None) -> Any:
        """Move the slicing of a tensor from `src_dim` (whose whole size is `total`; this rank holds its part, in
        tensor_split sizes or in proportion to `src_shares`) to `dim` (parts likewise by `shares`): one
        all_to_all_single, each rank sending every other the piece of its part that rank keeps."""
        if (alone := self._alone(x, out, async_op, group=group)) is not None:
            return alone
        n, me = dist.get_world_size(group), dist.get_rank(group)
        sent = parts(x.shape[dim], n, shares)
        came = parts(total, n, src_shares)
        mine = sent[me][1] - sent[me][0]
        host = self.backend == "gloo" and x.device.type != "cpu"  # Gloo's all-to-all takes host tensors
        wire = x.detach().to("cpu") if host else x
        inp = self.buffer((out, "in"), (wire.numel(),), wire.dtype, wire.device)
        at = 0
        for start, stop in sent:  # the piece each rank keeps, one after the other
            piece = wire.narrow(dim, start, stop - start)
            inp[at:at + piece.numel()].view(piece.shape).copy_(piece)
            at += piece.numel()
        shapes = [with_dim(with_dim(x.shape, src_dim, stop - start), dim, mine) for start, stop in came]
        counts = [math.prod(sh) for sh in shapes]
        got = self.buffer((out, "got"), (sum(counts),), wire.dtype, wire.device)
        pieces = [math.prod(with_dim(wire.shape, dim, stop - start)) for start, stop in sent]
        work = dist.all_to_all_single(got, inp, counts, pieces, group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            res = self.buffer(out, with_dim(with_dim(x.shape, src_dim, total), dim, mine), x.dtype)
            for (start, stop), piece, shape in zip(came, got.split(counts), shapes):
                res.narrow(src_dim, start, stop - start).copy_(piece.view(shape))
            return res

        return self._done(work if async_op else None, finish, async_op)

    def broadcast(self, x: torch.Tensor, root: int, group: Any, out: Any, async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op, group=group)) is not None:
            return alone
        buf = self.buffer(out, x.shape, x.dtype)
        buf.copy_(x)
        src = dist.get_global_rank(group, root) if group is not None else root
        work = dist.broadcast(buf, src=src, group=group, async_op=async_op)
        return self._done(work if async_op else None, lambda: buf, async_op)

    def reduce(self, x: torch.Tensor, op: str, root: int, group: Any, out: Any, async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op, group=group)) is not None:
            return alone
        wire = self._wire(x)
        buf = self.buffer((out, "wire"), wire.shape, wire.dtype)
        buf.copy_(wire)
        dst = dist.get_global_rank(group, root) if group is not None else root
        work = dist.reduce(buf, dst=dst, op=_REDUCE[op], group=group, async_op=async_op)
        is_root = dist.get_rank(group) == root

        def finish() -> torch.Tensor:
            res = self.buffer(out, x.shape, x.dtype)
            if is_root:
                res.copy_(buf / dist.get_world_size(group) if op == "avg" else buf)
            else:
                res.copy_(x)  # the other ranks keep their own input
            return res

        return self._done(work if async_op else None, finish, async_op)

    def send_recv(self, x: torch.Tensor | None, peer: int, sending: bool, shape: Sequence[int], dtype: torch.dtype,
                  out: Any, async_op: bool = False) -> Any:
        """Group rank i of the sending stage sends to group rank i of the receiving stage. Under Gloo a message
        crosses in host memory (its point-to-point takes no CUDA pointer: writev fails with 'Bad address')."""
        host = self.backend == "gloo" and self.device.type != "cpu"
        if sending:
            wire = x.detach().to("cpu") if host else x.contiguous()
            work = dist.isend(wire.contiguous(), dst=peer)
            return self._done(work, lambda: None, async_op)  # the work holds `wire` until the send completes
        buf = self.buffer(out, shape, dtype)
        if not host:
            return self._done(dist.irecv(buf, src=peer), lambda: buf, async_op)
        wire = self.buffer((out, "host"), shape, dtype, torch.device("cpu"))
        return self._done(dist.irecv(wire, src=peer), lambda: buf.copy_(wire), async_op)

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

    def _rows(self, rows: int, row: int, n: int, shares: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """(flat start, length) of each rank's part of a tensor of `rows` rows of `row` elements."""
        return [(start * row, (stop - start) * row) for start, stop in parts(rows, n, shares)]

    def shm_all_reduce(self, x: torch.Tensor, op: str, group: Any, out: Any, async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op, group=group)) is not None:
            return alone
        g = self._shm_group(group, x) if op != "adasum" else None
        wire = self._wire(x).reshape(-1)
        slots = None if g is None else self._shm_slots(g, out, wire.numel(), wire.dtype)
        if g is None or slots is None:
            return self.all_reduce(x, op, group, out, async_op)
        res = self.buffer((out, "wire") if wire.dtype != x.dtype else out, x.shape, wire.dtype)
        parts = self._rows(wire.numel(), 1, g.size)
        shm.all_reduce(g, slots, wire if wire.is_contiguous() else wire.contiguous(), op, parts, res.view(-1))
        if res.dtype != x.dtype:
            res = self.buffer(out, x.shape, x.dtype).copy_(res)
        return self._done(None, lambda: res, async_op)

    def shm_reduce_scatter(self, x: torch.Tensor, op: str, dim: int, group: Any, out: Any,
                           async_op: bool = False, shares: Sequence[int] | None = None) -> Any:
        if (alone := self._alone(x, out, async_op, group=group)) is not None:
            return alone
        g = self._shm_group(group, x)
        wire = self._wire(x).movedim(dim, 0)
        flat = wire.reshape(-1) if wire.is_contiguous() else wire.contiguous().reshape(-1)
        slots = None if g is None else self._shm_slots(g, out, flat.numel(), flat.dtype)
        if g is None or slots is None:
            return self.reduce_scatter(x, op, dim, group, out, async_op, shares)
        rows = x.shape[dim]
        flat_parts = self._rows(rows, flat.numel() // rows if rows else 0, g.size, shares)
        mine = parts(rows, g.size, shares)[g.me]
        shape = with_dim(x.shape, dim, mine[1] - mine[0])
        if dim == 0 and wire.dtype == x.dtype:  # reduced in place in this rank's slot: valid until it is written
            reduced = shm.reduce_scatter(g, slots, flat, op, flat_parts).view(shape)
            return self._done(None, lambda: reduced, async_op)
        part = self.buffer((out, "part"), (mine[1] - mine[0], *wire.shape[1:]), flat.dtype)
        shm.reduce_scatter(g, slots, flat, op, flat_parts, part.view(-1))
        res = self.buffer(out, shape, x.dtype)
        res.movedim(dim, 0).copy_(part)
        return self._done(None, lambda: res, async_op)

    def shm_all_gather(self, x: torch.Tensor, dim: int, total: int, group: Any, out: Any,
                       async_op: bool = False, into: torch.Tensor | None = None, deferrable: bool = False,
                       shares: Sequence[int] | None = None) -> Any:
        if (alone := self._alone(x, out, async_op, into, group)) is not None:
            return alone
        g = self._shm_group(group, x)
        if g is None:
            return self.all_gather(x, dim, total, group, out, async_op, into, deferrable, shares=shares)
        res = into if into is not None else self.buffer(out, with_dim(x.shape, dim, total), x.dtype)
        xt = x.movedim(dim, 0)
        flat = xt.reshape(-1) if xt.is_contiguous() else xt.contiguous().reshape(-1)
        row = flat.numel() // x.shape[dim] if x.shape[dim] else math.prod(xt.shape[1:])
        bounds = parts(total, g.size, shares)
        flat_bounds = [(a * row, (b - a) * row) for a, b in bounds]
        common = self.shm_buffers.commons.get((out, "whole"))
        if into is not None and dim == 0 and common is not None and into.data_ptr() == common[0].data_ptr():
            # the state is stored once for the group (Executable.shared_input): parts in place, one barrier
            shm.gather_common(g, common[0], flat_bounds, flat)
            return self._done(None, lambda: res, async_op)
        wholes = self.shm_buffers.slots.get((out, "whole"))
        if into is not None and dim == 0 and wholes is not None and into.data_ptr() == wholes[g.me].data_ptr():
            # the state lives in shared memory (Executable.shared_input): the others read this rank's part there
            shm.gather_in_place(g, wholes, flat_bounds, flat)
            return self._done(None, lambda: res, async_op)
        biggest = max(stop - start for start, stop in bounds)
        slots = self._shm_slots(g, out, biggest * row, x.dtype)
        if slots is None:
            return self.all_gather(x, dim, total, group, out, async_op, into, deferrable, shares=shares)
        rt_ = res.movedim(dim, 0)
        outs = [rt_[start:stop] for start, stop in bounds]
        if dim == 0 and res.is_contiguous():
            shm.all_gather(g, slots, flat, outs)
        else:  # gather flat pieces, then place them along `dim`
            tmp = [self.buffer((out, "piece", j), o.shape, x.dtype) for j, o in enumerate(outs)]
            shm.all_gather(g, slots, flat, tmp)
            for o, t in zip(outs, tmp):
                o.copy_(t)
        return self._done(None, lambda: res, async_op)

    def shm_send_recv(self, x: torch.Tensor | None, peer: int, sending: bool, shape: Sequence[int],
                      dtype: torch.dtype, out: Any, async_op: bool = False) -> Any:
        """Group rank i of the sending stage hands its tensor to group rank i of the receiving stage through shared
        memory (the library's send where the two do not share this host)."""
        if out not in self._pairs:
            sender, receiver = (self.rank, peer) if sending else (peer, self.rank)
            # both sides decide alike: on the host's memory only, and proven (or not) between the two through the store
            self._pairs[out] = shm.Pair.make(sender, receiver, str(out), math.prod(shape), dtype) \
                if self.device.type == "cpu" else None
        pair = self._pairs[out]
        if pair is None:
            return self.send_recv(x, peer, sending, shape, dtype, out, async_op)
        if sending:
            pair.send(x)
            return self._done(None, lambda: None, async_op)
        buf = pair.recv(self.buffer(out, shape, dtype))
        return self._done(None, lambda: buf, async_op)

    # -- ring algorithms (ring.py): synchronous, point-to-point ---------------------------------
    def ring_all_reduce(self, x: torch.Tensor, op: str, group: Any, out: Any) -> torch.Tensor:
        """A ring reduce-scatter then a ring all-gather of the flattened tensor (balanced parts)."""
        if (alone := self._alone(x, out, False, group=group)) is not None:
            return alone
        res = self.buffer(out, x.shape, x.dtype)
        flat = x.reshape(-1)
        start, stop = slice_bounds(flat.numel(), dist.get_world_size(group), dist.get_rank(group))
        part = self.buffer((out, "part"), (stop - start,), x.dtype)
        ring.ring_reduce_scatter(flat, 0, op, group, part)
        ring.ring_all_gather(part, 0, group, res.view(-1))
        return res

    def ring_reduce_scatter(self, x: torch.Tensor, op: str, dim: int, group: Any, out: Any,
                            shares: Sequence[int] | None = None) -> torch.Tensor:
        if (alone := self._alone(x, out, False, group=group)) is not None:
            return alone
        start, stop = parts(x.shape[dim], dist.get_world_size(group), shares)[dist.get_rank(group)]
        res = self.buffer(out, with_dim(x.shape, dim, stop - start), x.dtype)
        ring.ring_reduce_scatter(x, dim, op, group, res, shares)
        return res

    def ring_all_gather(self, x: torch.Tensor, dim: int, total: int, group: Any, out: Any,
                        into: torch.Tensor | None = None, deferrable: bool = False,
                        shares: Sequence[int] | None = None) -> torch.Tensor:
        if (alone := self._alone(x, out, False, into, group)) is not None:
            return alone
        res = into if into is not None else self.buffer(out, with_dim(x.shape, dim, total), x.dtype)
        ring.ring_all_gather(x, dim, group, res, shares)
        return res

    def fused_ring(self, x: torch.Tensor, dim: int, op: str, group: Any,
                   compute: Callable[[torch.Tensor, tuple[int, int]], tuple[list, list]],
                   gathered: Sequence[tuple[Any, Sequence[int], torch.dtype]],
                   kept: Sequence[tuple[Any, Sequence[int], torch.dtype]],
                   subchunks: int = 2, shares: Sequence[int] | None = None) -> tuple[list[torch.Tensor],
                                                                                    list[torch.Tensor]]:
        """CoCoNet's fused RS-C-AG (ring.fused_ring). `compute(piece, (offset, length))` returns the
        piece of every gathered output and of every kept value (this rank's part, assembled here)."""
        outs = [self.buffer(key, shape, dtype) for key, shape, dtype in gathered]
        keep = [self.buffer(key, shape, dtype) for key, shape, dtype in kept]

        def piece(reduced: torch.Tensor, offset: int, length: int) -> list[torch.Tensor]:
            results, parts = compute(reduced, (offset, length))
            for buf, part in zip(keep, parts):
                buf.narrow(dim, offset, length).copy_(part)
            return [r.expand(*with_dim(o.shape, dim, length)) for r, o in zip(results, outs)]

        if not dist.is_initialized():  # one rank alone: its tensor is the reduced whole, a single piece
            for o, r in zip(outs, piece(x, 0, x.shape[dim])):
                o.copy_(r)
            return outs, keep
        ring.fused_ring(x, dim, op, group, piece, outs, subchunks, shares)
        return outs, keep

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

