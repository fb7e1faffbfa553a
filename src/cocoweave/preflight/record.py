"""Recording mode: the communication one rank really issues during a live step, in the trace form the
predictor writes. For the duration of the `recording()` block, torch.distributed.pipelining's `_batch_p2p` (every
send and receive of the schedules goes through it) and torch.distributed's send/recv and collectives are wrapped
to write each operation down before it runs; nothing else changes.

Each recorded collective is sorted by where it was called: the ones the predictor covers (the stage boundary's
all-gathers in StageModule, Pipeline.step's loss all-reduces) go into the trace; the rest (the tensor-parallel
collectives inside blocks, the optimizer's reductions) into `Recording.other`, listed but not compared."""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import collectives
from .trace import P2P, Op, Trace

# torch.distributed functions wrapped beyond every registered collective kind's own (collectives.kinds.recorded),
# each with the argument whose size crosses (as the predictor writes it)
DATA_ARGUMENT = {"all_gather": "tensor", "all_gather_into_tensor": "input_tensor", "all_gather_single": "input_tensor",
                 "reduce_scatter_tensor": "input", "reduce_scatter_single": "input", "all_to_all_single": "input",
                 "reduce_scatter": "output", "barrier": "", "send": "tensor", "recv": "tensor"}
# frames (co_qualname) whose collective is the stage boundary's or the step's: what the predictor covers
BOUNDARY_CALLERS = ("_GatherFromParallel.forward", "_ScatterToParallel.backward")


@dataclass
class Recording:
    """What one rank issued: `trace` (the covered operations, comparable with a prediction) and `other` (every
    other collective, described)."""

    rank: int
    trace: Trace = field(default_factory=Trace)
    other: list[Op] = field(default_factory=list)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


def _site() -> str:
    """'step' when Pipeline.step called the collective, 'boundary' when a stage boundary's gather did, else ''."""
    f = sys._getframe(2)  # the caller of the wrapped function
    if f.f_code.co_qualname == "Pipeline.step":
        return "step"
    if f.f_code.co_name == "all_gather_cat" and f.f_back is not None \
            and f.f_back.f_code.co_qualname in BOUNDARY_CALLERS:
        return "boundary"
    return ""


_local = threading.local()


@contextmanager
def recording(rank: int | None = None, optimizer: Any = None) -> Iterator[Recording]:
    """Record this rank's communication inside the block (one training step, typically). With a cocoweave.optim
    distributed `optimizer`, also each collective stage its step runs (cocoweave.optim.stepping.finish drives
    them; on one host they go through shared memory, where torch.distributed does not see them)."""
    from torch.distributed.pipelining import schedules as S

    from ..optim import stepping

    me = dist.get_rank() if rank is None else rank
    rec = Recording(me)
    saved_batch, saved_finish = S._batch_p2p, stepping.finish
    buckets = {id(b.exe): b for b in getattr(optimizer, "_buckets", [])}
    dp = _ranks(getattr(optimizer, "process_group", None)) if optimizer is not None else ()

    def finish(steps: Iterator[Any], exe: Any, phases: dict[str, float]) -> Any:
        b = buckets.get(id(exe))

        def seen() -> Iterator[Any]:
            while True:
                try:
                    item = next(steps)
                except StopIteration as done:
                    return done.value
                kind = exe.stage_op(item[0])
                if kind and b is not None:
                    rec.trace.add_op(me, Op(kind, dp, None, int(b.numel), str(b.dtype).removeprefix("torch."),
                                            "optimizer"))
                yield item

        return saved_finish(seen(), exe, phases)
    # the argument whose size crosses: named above, else the registered kind's (by position)
    data: dict[str, str | int] = {fn: index for fn, (_, index, _) in collectives.kinds.recorded().items()}
    data.update(DATA_ARGUMENT)
    saved = {name: getattr(dist, name) for name in data if hasattr(dist, name)}

    def batch_p2p(ops: list[dist.P2POp], desc: str | None = None) -> Any:
        for op in ops:
            kind = "send" if op.op.__name__ == "isend" else "recv"
            rec.trace.add_op(me, Op(kind, _ranks(op.group), int(op.peer), op.tensor.numel(), _dtype(op.tensor),
                                    desc or ""))
        return saved_batch(ops, desc)

    def wrap(name: str) -> Any:
        fn = saved[name]
        signature = inspect.signature(fn)
        arg = data[name]
        crossing = list(signature.parameters)[arg] if isinstance(arg, int) else arg

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if getattr(_local, "inside", False):
                return fn(*args, **kwargs)
            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError:  # torch says what is wrong with the call
                return fn(*args, **kwargs)
            tensor, group = given.get(crossing), given.get("group")
            peer = given.get("dst" if name == "send" else "src") if name in P2P else None
            local_peer = given.get("group_dst" if name == "send" else "group_src") if name in P2P else None
            if peer is None and local_peer is not None:
                peer = dist.get_global_rank(group, local_peer) if group is not None else local_peer
            numel = tensor.numel() if isinstance(tensor, torch.Tensor) else 0
            dtype = _dtype(tensor) if isinstance(tensor, torch.Tensor) else ""
            site = _site() if name not in P2P else "p2p"
            op = Op(name, _ranks(group), None if peer is None else int(peer), numel, dtype, site)
            if site:
                rec.trace.add_op(me, op)
            else:
                rec.other.append(op)
            _local.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                _local.inside = False

        wrapped.__name__ = name
        return wrapped

    S._batch_p2p, stepping.finish = batch_p2p, finish
    for name in saved:
        setattr(dist, name, wrap(name))
    try:
        yield rec
    finally:
        S._batch_p2p, stepping.finish = saved_batch, saved_finish
        for name, fn in saved.items():
            setattr(dist, name, fn)
