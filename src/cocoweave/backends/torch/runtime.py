"""What generated step functions call: per-rank buffers, collectives, P2P, the chunk pipeline,
dropout and trace spans. One `RankContext` per executable; buffers are allocated on first use and
reused by every later step.

Uneven splits (torch.tensor_split sizes) are handled by padding every part to the largest one, so
the library's equal-size reduce_scatter / all_gather apply; when the split is even along dim 0 the
tensors are used as they are, without copies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ... import faults, rng
from ...ir.layout import slice_bounds
from ...ir.semantics import reduce_local
from . import ring
from .ring import with_dim  # generated code calls rt.with_dim

_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
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
                 indices: dict[str, torch.Tensor], backend: str):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.groups, self.indices, self.backend = groups, indices, backend
        self.buffers: dict[Any, torch.Tensor] = {}
        self._masks: dict[tuple[str, int], torch.Tensor] = {}  # dropout masks of constant seeds
        self.events: list[tuple[str, str, int, int, int | None]] = []
        self.tracing = False
        self.kernels: dict[int, Any] = {}  # stage index -> generated Triton kernel (kernels.codegen)

    # -- resources ----------------------------------------------------------------------------
    def group(self, name: str) -> Any:
        return self.groups[name]

    def fused(self, stage: int) -> Any:
        return self.kernels[stage]

    def index(self, name: str) -> torch.Tensor:
        return self.indices[name]

    def keep(self, name: str, p: float, key: int) -> torch.Tensor:
        """The keep mask of dropout `name` for a seed that is a program constant: the same every step (it
        depends only on the seed, the logical index and the rank), so it is hashed once and kept."""
        mask = self._masks.get((name, key))
        if mask is None:
            mask = self._masks[(name, key)] = keep_mask(self.indices[name], p, key)
        return mask

    def buffer(self, key: Any, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor owned by this executable, allocated on first use and reused by later steps."""
        shape = tuple(shape)
        b = self.buffers.get(key)
        if b is None or tuple(b.shape) != shape or b.dtype != dtype:
            b = self.buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
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

    def _alone(self, x: torch.Tensor, out: Any, async_op: bool) -> Any | None:
        """A world of one rank without torch.distributed: every collective gives this rank's own tensor
        (the identity; avg and adasum of one tensor are the tensor). None when the group has peers."""
        if dist.is_initialized():
            return None
        res = self.buffer(out, x.shape, x.dtype)
        res.copy_(x)
        return self._done(None, lambda: res, async_op)

    def all_reduce(self, x: torch.Tensor, op: str, group: Any, out: Any, async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op)) is not None:
            return alone
        n = dist.get_world_size(group)
        if op == "adasum":
            return self._adasum(x, group, out)
        wire = self._wire(x)
        key = (out, "wire") if wire is not x else out
        buf = self.buffer(key, wire.shape, wire.dtype)
        buf.copy_(wire)
        work = dist.all_reduce(buf, _REDUCE[op], group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            if op == "avg":
                buf.div_(n)
            if buf.dtype == x.dtype:
                return buf
            res = self.buffer(out, x.shape, x.dtype)
            res.copy_(buf)
            return res

        return self._done(work if async_op else None, finish, async_op)

    def _adasum(self, x: torch.Tensor, group: Any, out: Any) -> torch.Tensor:
        """Adasum by vector-halving, distance-doubling over P2P (backends/torch/adasum.py): bandwidth
        like a ring all-reduce, combining in exactly the reference's order on any group size."""
        from .adasum import adasum_all_reduce

        return adasum_all_reduce(x, group, self.buffer(out, x.shape, x.dtype))

    def reduce_scatter(self, x: torch.Tensor, op: str, dim: int, group: Any, out: Any,
                       async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op)) is not None:
            return alone
        n, me = dist.get_world_size(group), dist.get_rank(group)
        size = x.shape[dim]
        bounds = [slice_bounds(size, n, r) for r in range(n)]
        c = max(stop - start for start, stop in bounds)
        wire = self._wire(x).movedim(dim, 0)
        rest = tuple(wire.shape[1:])
        if size % n == 0 and dim == 0 and wire.is_contiguous():
            inp = wire
        else:  # pad each rank's segment to c rows so that equal-size reduce_scatter applies
            inp = self.buffer((out, "in"), (c * n, *rest), wire.dtype)
            for r, (start, stop) in enumerate(bounds):
                inp[r * c:r * c + stop - start].copy_(wire[start:stop])
        part = self.buffer((out, "part"), (c, *rest), wire.dtype)
        work = _REDUCE_SCATTER(part, inp, op=_REDUCE[op], group=group, async_op=async_op)
        mine = bounds[me][1] - bounds[me][0]

        def finish() -> torch.Tensor:
            res = self.buffer(out, with_dim(x.shape, dim, mine), x.dtype)
            res.movedim(dim, 0).copy_(part[:mine])
            if op == "avg":
                res.div_(n)
            return res

        return self._done(work if async_op else None, finish, async_op)

    def all_gather(self, x: torch.Tensor, dim: int, total: int, group: Any, out: Any, async_op: bool = False) -> Any:
        """Gather the ranks' tensor_split parts of a tensor whose whole size along `dim` is `total`."""
        if (alone := self._alone(x, out, async_op)) is not None:
            return alone
        n = dist.get_world_size(group)
        bounds = [slice_bounds(total, n, r) for r in range(n)]
        sizes = [stop - start for start, stop in bounds]
        c = max(sizes)
        xt = x.movedim(dim, 0)
        rest = tuple(xt.shape[1:])
        full_shape = with_dim(x.shape, dim, total)
        res = self.buffer(out, full_shape, x.dtype)
        if total % n == 0 and dim == 0 and x.is_contiguous():
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

    def broadcast(self, x: torch.Tensor, root: int, group: Any, out: Any, async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op)) is not None:
            return alone
        buf = self.buffer(out, x.shape, x.dtype)
        buf.copy_(x)
        src = dist.get_global_rank(group, root) if group is not None else root
        work = dist.broadcast(buf, src=src, group=group, async_op=async_op)
        return self._done(work if async_op else None, lambda: buf, async_op)

    def reduce(self, x: torch.Tensor, op: str, root: int, group: Any, out: Any, async_op: bool = False) -> Any:
        if (alone := self._alone(x, out, async_op)) is not None:
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
        """Group rank i of the sending stage sends to group rank i of the receiving stage."""
        if sending:
            work = dist.isend(x.contiguous(), dst=peer)
            return self._done(work, lambda: None, async_op)
        buf = self.buffer(out, shape, dtype)
        work = dist.irecv(buf, src=peer)
        return self._done(work, lambda: buf, async_op)

    # -- ring algorithms (ring.py): synchronous, point-to-point ---------------------------------
    def ring_all_reduce(self, x: torch.Tensor, op: str, group: Any, out: Any) -> torch.Tensor:
        """A ring reduce-scatter then a ring all-gather of the flattened tensor (balanced parts)."""
        if (alone := self._alone(x, out, False)) is not None:
            return alone
        res = self.buffer(out, x.shape, x.dtype)
        flat = x.reshape(-1)
        start, stop = slice_bounds(flat.numel(), dist.get_world_size(group), dist.get_rank(group))
        part = self.buffer((out, "part"), (stop - start,), x.dtype)
        ring.ring_reduce_scatter(flat, 0, op, group, part)
        ring.ring_all_gather(part, 0, group, res.view(-1))
        return res

    def ring_reduce_scatter(self, x: torch.Tensor, op: str, dim: int, group: Any, out: Any) -> torch.Tensor:
        if (alone := self._alone(x, out, False)) is not None:
            return alone
        start, stop = slice_bounds(x.shape[dim], dist.get_world_size(group), dist.get_rank(group))
        res = self.buffer(out, with_dim(x.shape, dim, stop - start), x.dtype)
        ring.ring_reduce_scatter(x, dim, op, group, res)
        return res

    def ring_all_gather(self, x: torch.Tensor, dim: int, total: int, group: Any, out: Any) -> torch.Tensor:
        if (alone := self._alone(x, out, False)) is not None:
            return alone
        res = self.buffer(out, with_dim(x.shape, dim, total), x.dtype)
        ring.ring_all_gather(x, dim, group, res)
        return res

    def fused_ring(self, x: torch.Tensor, dim: int, op: str, group: Any,
                   compute: Callable[[torch.Tensor, tuple[int, int]], tuple[list, list]],
                   gathered: Sequence[tuple[Any, Sequence[int], torch.dtype]],
                   kept: Sequence[tuple[Any, Sequence[int], torch.dtype]],
                   subchunks: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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
        ring.fused_ring(x, dim, op, group, piece, outs, subchunks)
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

