"""The I/O half of the step recorder `cocoweave profile` installs in each rank: the input pipeline, checkpoints and
host-device copies, wrapped from outside the user's script as the recorder (`recorder.py`) wraps optimizers and modules.

Per step it records: the wall and main-thread CPU time spent inside `DataLoader.__iter__` and the loader
iterator's `__next__` (waiting for data), batches taken, bytes read by this process and by the loader's worker
processes (`/proc/<pid>/io`: `read_bytes` from storage, `rchar` through read calls, page cache included), the
workers' CPU time (`/proc/<pid>/stat`), each loader's workers and prefetch depth; every `torch.save`/`torch.load`,
`torch.distributed.checkpoint` save/load and `cocoweave.checkpoint` save/load (time, and bytes: this process's
`wchar`/`rchar` during the call, or a file-like target's growth); and on a GPU host every `Tensor.to`/`.cuda`/
`.cpu` copy between host and device (wall time of the call; a non-blocking copy's time is its launch only). On a
host without a GPU nothing is wrapped for transfers and they are recorded as zero.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

IO_FIELDS = ("read_bytes", "rchar", "wchar")
CHECKPOINT_TARGETS = (  # (module, attribute, operation label)
    ("torch", "save", "torch.save"), ("torch", "load", "torch.load"),
    ("torch.distributed.checkpoint", "save", "dcp.save"), ("torch.distributed.checkpoint", "load", "dcp.load"),
    ("cocoweave.checkpoint", "save", "cocoweave.checkpoint.save"),
    ("cocoweave.checkpoint", "load", "cocoweave.checkpoint.load"),
)
NO_GPU_NOTE = "no GPU on this host: host-device transfers are zero (nothing is copied)"
ASYNC_NOTE = "a non-blocking copy's time is its launch; the copy itself overlaps later work"


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """`read_bytes`, `rchar` and `wchar` of a process from /proc/<pid>/io; {} where it cannot be read."""
    try:
        with open(f"/proc/{pid}/io") as f:
            pairs = (line.split(":", 1) for line in f)
            return {k: int(v) for k, v in pairs if k in IO_FIELDS}
    except (OSError, ValueError):
        return {}


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (/proc/<pid>/stat); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _file_position(target: Any) -> int | None:
    try:
        return int(target.tell()) if hasattr(target, "tell") else None
    except (OSError, ValueError):
        return None


class IoRecorder:
    """Accumulates one step's I/O; `take_step()` returns it as a JSON-able dict and starts the next step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, gpu: bool | None = None) -> None:
        self.clock = clock
        self.gpu = torch.cuda.is_available() if gpu is None else gpu
        self.loaders: dict[int, dict[str, Any]] = {}  # id(DataLoader) -> what it is
        self.workers: dict[int, tuple[dict[str, int], float]] = {}  # worker pid -> last (io, cpu s)
        self.depth = 0  # nested checkpoint calls (cocoweave.checkpoint calls torch's): the outermost counts
        self.io0 = proc_io()
        self.wrapped_modules: set[str] = set()
        self._reset()

    def _reset(self) -> None:
        self.wait_s = self.wait_cpu_s = 0.0
        self.batches = 0
        self.checkpoints: list[list[Any]] = []
        self.transfer = {"ms": 0.0, "bytes": 0, "count": 0, "async": 0, "pinned": 0}

    # -- the input pipeline ---------------------------------------------------------------------------
    def timed_data(self, fn: Callable[..., Any], loader_call: bool) -> Callable[..., Any]:
        """`fn` (DataLoader.__iter__ or the iterator's __next__) adding its wall and CPU time to the data wait."""

        def wrapped(obj: Any, *args: Any, **kwargs: Any) -> Any:
            start, cpu = self.clock(), time.thread_time()
            try:
                result = fn(obj, *args, **kwargs)
            finally:
                self.wait_s += self.clock() - start
                self.wait_cpu_s += time.thread_time() - cpu
            if loader_call:
                self._loader(obj, result)
            else:
                self.batches += 1
            return result

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def _loader(self, loader: Any, iterator: Any) -> None:
        workers = getattr(iterator, "_workers", None) or []
        fresh = not getattr(loader, "persistent_workers", False)
        for w in workers:  # a worker the iterator just started: everything it read and ran since is this step's (a
            # baseline read now would lose the samples it prefetched before this line, as a loaded machine showed);
            # a persistent one may have run before the recording: from now on
            if w.pid is not None and w.pid not in self.workers:
                self.workers[w.pid] = ((dict.fromkeys(IO_FIELDS, 0), 0.0) if fresh else
                                       (proc_io(w.pid), proc_cpu_s(w.pid) or 0.0))
        n = int(getattr(loader, "num_workers", 0))
        self.loaders[id(loader)] = {
            "num_workers": n, "prefetch_factor": getattr(loader, "prefetch_factor", None) if n else None,
            "batch_size": getattr(loader, "batch_size", None), "pin_memory": bool(getattr(loader, "pin_memory", 0)),
            "persistent_workers": bool(getattr(loader, "persistent_workers", False))}

    def _worker_deltas(self) -> tuple[dict[str, int], float, int]:
        io_sum = dict.fromkeys(IO_FIELDS, 0)
        cpu_sum, alive = 0.0, 0
        for pid, (io0, cpu0) in list(self.workers.items()):
            io1, cpu1 = proc_io(pid), proc_cpu_s(pid)
            if not io1 and cpu1 is None:  # ended (a loader's epoch is over): its last reads since the step are lost
                del self.workers[pid]
                continue
            alive += 1
            for k in IO_FIELDS:
                io_sum[k] += max(io1.get(k, 0) - io0.get(k, 0), 0)
            cpu_sum += max((cpu1 or cpu0) - cpu0, 0.0)
            self.workers[pid] = (io1 or io0, cpu1 or cpu0)
        return io_sum, cpu_sum, alive

    # -- checkpoints ------------------------------------------------------------------------------------
    def timed_checkpoint(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (a save or load) recording its time and the bytes this process wrote (saves) or read (loads)."""
        field = "wchar" if label.endswith("save") else "rchar"

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            target = args[1] if label == "torch.save" and len(args) > 1 else kwargs.get("f")
            pos0, io0, start = _file_position(target), proc_io(), self.clock()
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                ms = 1e3 * (self.clock() - start)
                nbytes = proc_io().get(field, 0) - io0.get(field, 0)
                pos1 = _file_position(target)
                if pos0 is not None and pos1 is not None and not isinstance(target, (str, os.PathLike)):
                    nbytes = max(nbytes, pos1 - pos0)  # an in-memory buffer moves no bytes through the kernel
                self.checkpoints.append([label, ms, max(nbytes, 0)])

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    # -- host-device transfers -------------------------------------------------------------------------
    def timed_transfer(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (Tensor.to/.cuda/.cpu) recording the time and bytes of copies between host and device."""

        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            start = self.clock()
            out = fn(tensor, *args, **kwargs)
            if isinstance(out, torch.Tensor) and out.device.type != tensor.device.type:
                t = self.transfer
                t["ms"] += 1e3 * (self.clock() - start)
                t["bytes"] += out.numel() * out.element_size()
                t["count"] += 1
                t["async"] += int(bool(kwargs.get("non_blocking", False)))
                t["pinned"] += int(tensor.device.type == "cpu" and tensor.is_pinned())
            return out

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    # -- one step -------------------------------------------------------------------------------------
    def take_step(self) -> dict[str, Any]:
        """This step's I/O record (see the module docstring), then start counting the next step."""
        io1 = proc_io()
        worker_io, worker_cpu, alive = self._worker_deltas()
        wrap_checkpoints(self)  # a checkpoint module the script imported since
        doc: dict[str, Any] = {
            "data_wait_ms": 1e3 * self.wait_s, "data_cpu_ms": 1e3 * self.wait_cpu_s, "batches": self.batches,
            **{k: max(io1.get(k, 0) - self.io0.get(k, 0), 0) for k in IO_FIELDS},
            **{f"worker_{k}": v for k, v in worker_io.items()}, "worker_cpu_ms": 1e3 * worker_cpu,
            "workers_alive": alive, "loaders": list(self.loaders.values()), "checkpoints": self.checkpoints,
            "transfers": dict(self.transfer) if self.gpu else None}
        self.io0 = io1 or self.io0
        self._reset()
        return doc


def wrap_checkpoints(recorder: IoRecorder) -> None:
    """Wrap the save and load functions of every checkpoint module imported so far and not yet wrapped. They are
    not imported here (torch.distributed.checkpoint takes most of a second): a module the script imports is
    wrapped when the recorder is installed, if imported before, or at the end of the next step."""
    for module_name, attr, label in CHECKPOINT_TARGETS:
        module = sys.modules.get(module_name)
        if module is None or f"{module_name}.{attr}" in recorder.wrapped_modules or not hasattr(module, attr):
            continue
        setattr(module, attr, recorder.timed_checkpoint(label, getattr(module, attr)))
        recorder.wrapped_modules.add(f"{module_name}.{attr}")


def install(recorder: IoRecorder) -> None:
    """Wrap the DataLoader, the checkpoint functions and (with a GPU) the host-device copies for `recorder`."""
    from torch.utils.data import dataloader

    dataloader.DataLoader.__iter__ = recorder.timed_data(  # type: ignore[method-assign]
        dataloader.DataLoader.__iter__, loader_call=True)
    dataloader._BaseDataLoaderIter.__next__ = recorder.timed_data(  # type: ignore[method-assign]
        dataloader._BaseDataLoaderIter.__next__, loader_call=False)
    wrap_checkpoints(recorder)
    if recorder.gpu:
        for name in ("to", "cuda", "cpu"):
            setattr(torch.Tensor, name, recorder.timed_transfer(getattr(torch.Tensor, name)))
