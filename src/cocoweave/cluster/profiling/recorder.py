"""What `cocoweave profile` installs inside each rank of a training script: per-step timings as JSON lines.

A step ends when the script's optimizer finishes `step()` (torch's global optimizer hooks, so any
`torch.optim.Optimizer`, DDP + torch.optim and `cocoweave.optim` alike, needs no change to the script).
Within a step: `data` runs from the end of the previous step to the first top-level module call,
`forward` from there to the end of the last top-level module call, `backward` from there until
`optimizer.step()` starts (loss, zero_grad, backward and DDP's wait for its all-reduce), `update` is
`optimizer.step()` itself; an optimizer exposing `last_step_ms` ({"reduce", "update", "gather"}) splits
it further. Each rank also records its CPU time (the main thread computes; Gloo's threads move the
bytes), every `torch.distributed` collective called from Python and every collective of cocoweave's
shared-memory algorithm (count, bytes, wall time when synchronous), DDP's gradient all-reduce, and, in
one untimed step, the FLOPs and memory traffic of every operation (for roofline predictions on other hardware).
With the environment set, each step's record also carries its I/O (`io_recorder.py`): time waiting on the
DataLoader, bytes read, checkpoints saved and loaded, host-device copies.

After `warmup + steps` steps every rank meets at a barrier and the process ends (exit code 0): what
the script does after its training loop (evaluation, saving) does not run under the profiler.

The environment says what to do: `COCOWEAVE_PROFILE_DIR` (where `rank<R>.jsonl` goes; unset: nothing is
installed), `COCOWEAVE_PROFILE_STEPS`, `COCOWEAVE_PROFILE_WARMUP`.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ... import collectives, settings
from ...rankenv import RankEnv
from . import io_recorder
from .io_recorder import IoRecorder

DIR_ENV, STEPS_ENV, WARMUP_ENV = settings.PROFILE_DIR.name, settings.PROFILE_STEPS.name, settings.PROFILE_WARMUP.name
COUNTED_STEP = 1  # the untimed step whose operations are counted (step 0 has no start boundary)

# Point-to-point calls wrapped at torch.distributed's Python surface: name -> (kind, index of the tensor whose bytes
# count, whether it holds one rank's part); each collective kind names its own functions (collectives/kinds.py).
# isend/irecv stay as they are (P2POp accepts only the originals); their bytes are counted in batch_isend_irecv.
P2P: dict[str, tuple[str, int, bool]] = {
    "send": ("send", 0, False), "recv": ("recv", 0, False), "batch_isend_irecv": ("p2p", 0, False),
}
# cocoweave's shared-memory collectives (backends/torch/shm.py; the optimizers' default on one host): name ->
# (kind, index of the tensor whose bytes count, whether it holds one rank's part). Their first argument is the group.
SHM_COLLECTIVES: dict[str, tuple[str, int, bool]] = {
    "all_reduce": ("all_reduce", 2, False), "reduce_scatter": ("reduce_scatter", 2, False),
    "all_gather": ("all_gather", 2, True), "gather_in_place": ("all_gather", 3, True),
    "gather_common": ("all_gather", 3, True),
    "open_all_reduce": ("all_reduce", 4, False),  # split in two (the TP layers' MM-AR@shm||MMw): bytes, no wall time
}
def watched() -> dict[str, tuple[str, int, bool]]:
    """Every torch.distributed function the recorder wraps, as in P2P: each registered collective kind's (e.g.
    all_gather (1, True): its list of tensors, one rank's part) and the point-to-point ones."""
    return {**collectives.kinds.recorded(), **P2P}


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


class OpCounter(TorchDispatchMode):
    """Counts every operation's FLOPs (torch's flop registry) and memory traffic (bytes of the tensors it
    reads and writes; views move nothing), in total and as a histogram of (flops, bytes, dtype) -> calls
    for per-operation rooflines. Collectives are left to the collective records."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.histogram: dict[tuple[float, float, str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's protocol)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace not in ("aten", "prims") or func.is_view:
            return out
        packet = func.overloadpacket
        flops = float(self.registry[packet](*args, **kwargs, out_val=out)) if packet in self.registry else 0.0
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor)]
        first = next((a for a in torch.utils._pytree.tree_leaves(out) if isinstance(a, torch.Tensor)), None)
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else "none"
        key = (flops, float(sum(_nbytes(t) for t in tensors)), dtype)
        self.histogram[key] = self.histogram.get(key, 0) + 1
        return out

    def snapshot(self) -> dict[str, Any]:
        """Totals and the histogram so far (a list of [flops, bytes, dtype, calls])."""
        hist = [[f, b, d, n] for (f, b, d), n in self.histogram.items()]
        return {"flops": sum(f * n for f, _, _, n in hist), "bytes": sum(b * n for _, b, _, n in hist),
                "ops": float(sum(n for *_, n in hist)), "histogram": hist}


class StepRecorder:
    """Per-rank step timings, written as JSON lines to `out`; ends the process after `warmup + steps` steps."""

    def __init__(self, out: Path, steps: int, warmup: int, clock: Callable[[], float] = time.perf_counter,
                 exit_process: Callable[[int], Any] = os._exit, io: IoRecorder | None = None) -> None:
        self.out, self.steps, self.warmup, self.clock, self.exit_process = out, steps, warmup, clock, exit_process
        self.io = io  # the input pipeline, checkpoints and host-device copies (io_recorder.py)
        self.step = 0
        self.depth = 0
        self.optimizer_id: int | None = None
        self.optimizer: Any = None
        self.ddp_bytes: list[tuple[int, int]] = []  # (gradient bytes, group size) of each DDP module
        self.counter: OpCounter | None = None
        self.counted: dict[str, dict[str, float]] = {}
        self.finished = False
        self._start_step(first=True)

    # -- step boundaries ---------------------------------------------------------------------------
    def _start_step(self, first: bool = False) -> None:
        now = self.clock()
        self.t = {"start": now, "forward_start": None, "forward_end": None, "update_start": None}
        self.cpu = (time.thread_time(), time.process_time())
        self.collectives: dict[str, list[float]] = {}
        if not first and self.step == COUNTED_STEP and self.step < self.warmup:
            self.counter = OpCounter()
            self.counter.__enter__()

    def module_pre(self, module: Any, args: Any) -> None:
        if self.depth == 0 and self.t["forward_start"] is None:
            self.t["forward_start"] = self.clock()
        self.depth += 1

    def module_post(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.t["forward_end"] = self.clock()

    def optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.optimizer_id is None:
            self.optimizer_id, self.optimizer = id(optimizer), optimizer
        if id(optimizer) == self.optimizer_id:
            self.t["update_start"] = self.clock()
            if self.counter is not None:
                self.counted["forward_backward"] = self.counter.snapshot()

    def optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if id(optimizer) != self.optimizer_id:
            return
        end = self.clock()
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            total = self.counter.snapshot()
            self.counted["update"] = _difference(total, self.counted.get("forward_backward"))
            self.counter = None
        if self.step == 0:
            self._write(self._header())
        self._write(self._record(end))
        self.step += 1
        if self.step >= self.warmup + self.steps:
            self.finish()
        self._start_step()

    def _record(self, end: float) -> dict[str, Any]:
        t = self.t
        fs = t["forward_start"] if t["forward_start"] is not None else t["start"]
        fe = t["forward_end"] if t["forward_end"] is not None else fs
        us = t["update_start"] if t["update_start"] is not None else end
        main, proc = time.thread_time() - self.cpu[0], time.process_time() - self.cpu[1]
        colls = dict(self.collectives)
        for nbytes, size in self.ddp_bytes:  # DDP's reducer all-reduces every gradient once per backward
            entry = colls.setdefault(f"all_reduce/ddp/p{size}", [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += nbytes
        phases = getattr(self.optimizer, "last_step_ms", None)
        return {"type": "step", "step": self.step, "timed": self.step >= self.warmup,
                "wall_ms": 1e3 * (end - t["start"]), "data_ms": 1e3 * (fs - t["start"]),
                "forward_ms": 1e3 * (fe - fs), "backward_ms": 1e3 * (us - fe), "update_ms": 1e3 * (end - us),
                "cpu_main_ms": 1e3 * main, "cpu_other_ms": 1e3 * max(proc - main, 0.0),
                "collectives": colls,
                "optimizer_phases_ms": dict(phases) if isinstance(phases, dict) else None,
                "io": self.io.take_step() if self.io is not None else None}

    def _header(self) -> dict[str, Any]:
        opt = self.optimizer
        params = [p for g in getattr(opt, "param_groups", []) for p in g.get("params", [])]
        state = [t for s in getattr(opt, "state", {}).values() if isinstance(s, dict)
                 for t in s.values() if isinstance(t, torch.Tensor)]
        return {"type": "header", "rank": _rank(), "world_size": _world_size(), "threads": torch.get_num_threads(),
                "optimizer": f"{type(opt).__module__}.{type(opt).__qualname__}",
                "has_last_step_ms": isinstance(getattr(opt, "last_step_ms", None), dict),
                "param_bytes": sum(_nbytes(p) for p in params), "state_bytes": sum(_nbytes(t) for t in state),
                "ddp": [list(x) for x in self.ddp_bytes], "load_avg": list(os.getloadavg())}

    def _write(self, doc: dict[str, Any]) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps(doc) + "\n")

    def write_counts(self) -> None:
        """Write the operation counts once (at the end of profiling, or when the script ends first)."""
        if not self.finished:
            self.finished = True
            self._write({"type": "counts", **self.counted})

    def finish(self) -> None:
        """Write the counts, meet the other ranks and end the process (exit code 0)."""
        self.write_counts()
        sys.stdout.flush()
        sys.stderr.flush()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self.exit_process(0)

    # -- collectives --------------------------------------------------------------------------------
    def _count(self, kind: str, size: int, nbytes: float, ms: float) -> None:
        """One call of a collective of `kind` over `size` ranks: its count, bytes and wall time (0 if async)."""
        entry = self.collectives.setdefault(f"{kind}/p{size}", [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += ms

    def collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (a torch.distributed function) recording its count, bytes and synchronous wall time."""
        kind, index, part = watched()[name]

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":  # bytes sent by this rank; the wait happens elsewhere
                p2p = args[0] if args else kwargs.get("p2p_op_list", [])
                nbytes = sum(_nbytes(op.tensor) for op in p2p if getattr(op.op, "__name__", "") == "isend")
                group = p2p[0].group if p2p else None
            else:
                tensor = args[index] if len(args) > index else kwargs.get("tensor", kwargs.get("input_tensor"))
                group = kwargs.get("group")
                nbytes = _nbytes(tensor)
            size = dist.get_world_size(group) if dist.is_initialized() else 1
            nbytes *= size if part else 1
            start = self.clock()
            result = fn(*args, **kwargs)
            sync = not kwargs.get("async_op", False) and name != "batch_isend_irecv"
            self._count(kind, size, nbytes, 1e3 * (self.clock() - start) if sync else 0.0)
            return result

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def shm_collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (a collective of cocoweave's shared-memory algorithm, synchronous) recording what `collective`
        records: the bytes of the whole (all-gathers: a rank's part times the ranks)."""
        kind, index, part = SHM_COLLECTIVES[name]

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            g = args[0]
            nbytes = _nbytes(args[index]) * (g.size if part else 1)
            start = self.clock()
            result = fn(*args, **kwargs)
            self._count(kind, g.size, nbytes, 1e3 * (self.clock() - start))
            return result

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped


def _difference(total: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The counts of `total` that came after the snapshot `before`."""
    if before is None:
        return total
    seen = {(f, b, d): n for f, b, d, n in before["histogram"]}
    hist = [[f, b, d, n - seen.get((f, b, d), 0)] for f, b, d, n in total["histogram"]]
    hist = [h for h in hist if h[3] > 0]
    return {"flops": total["flops"] - before["flops"], "bytes": total["bytes"] - before["bytes"],
            "ops": total["ops"] - before["ops"], "histogram": hist}


def _rank() -> int:
    return RankEnv.current().rank


def _world_size() -> int:
    return RankEnv.current().world_size


def install(recorder: StepRecorder) -> None:
    """Register the recorder's hooks: global optimizer and module hooks, wrapped collectives, DDP sizes."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(recorder.optimizer_pre)
    register_optimizer_step_post_hook(recorder.optimizer_post)
    register_module_forward_pre_hook(recorder.module_pre)
    register_module_forward_hook(recorder.module_post)
    for name in watched():
        if hasattr(dist, name):
            setattr(dist, name, recorder.collective(name, getattr(dist, name)))
    from ...backends.torch import shm

    for name in SHM_COLLECTIVES:
        setattr(shm, name, recorder.shm_collective(name, getattr(shm, name)))
    original_init = DistributedDataParallel.__init__

    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        grads = sum(_nbytes(p) for p in self.module.parameters() if p.requires_grad)
        recorder.ddp_bytes.append((grads, dist.get_world_size(self.process_group)))

    DistributedDataParallel.__init__ = ddp_init  # type: ignore[method-assign]
    if recorder.io is not None:
        io_recorder.install(recorder.io)


def install_from_env() -> StepRecorder | None:
    """Install a recorder as the environment asks (see the module's docstring); None when it asks nothing."""
    folder = settings.PROFILE_DIR.get()
    if not folder:
        return None
    env = RankEnv.from_env()
    if env.threads:
        torch.set_num_threads(env.threads)
    out = folder / f"rank{env.rank}.jsonl"
    out.unlink(missing_ok=True)
    recorder = StepRecorder(out, settings.PROFILE_STEPS.get(), settings.PROFILE_WARMUP.get(), io=IoRecorder())
    install(recorder)
    atexit.register(recorder.write_counts)  # the script ended before warmup + steps steps
    return recorder
