"""The I/O half of the step recorder: time waiting inside a real DataLoader, bytes read, the loader's workers
and prefetch depth, checkpoints timed with their bytes, transfers zero without a GPU; and the per-world summary."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from cocoweave.cluster.profiling.io_recorder import NO_GPU_NOTE, IoRecorder, proc_io
from cocoweave.cluster.profiling.io_summary import (
    checkpoint_stats,
    input_hint,
    measured_checkpoint,
    summarise_io,
    transfer_sentence,
)


class FileSamples(Dataset):
    """Each sample reads 4 KiB from a file and sleeps 2 ms (a slow decoder)."""

    def __init__(self, path) -> None:
        self.path = path

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.path, "rb") as f:
            f.seek(4096 * i)
            data = f.read(4096)
        time.sleep(0.002)
        return torch.tensor(len(data))


def wrapped_loader(rec: IoRecorder, loader: DataLoader):
    """Iterate `loader` through the recorder's wrappers (as `install` wraps DataLoader for the whole rank)."""
    it = rec.timed_data(DataLoader.__iter__, loader_call=True)(loader)
    step = rec.timed_data(type(it).__next__, loader_call=False)
    return it, step


def test_waiting_for_a_batch_and_the_bytes_read_are_one_step(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 128)
    rec = IoRecorder(gpu=False)
    loader = DataLoader(FileSamples(path), batch_size=4)
    it, next_batch = wrapped_loader(rec, loader)
    assert next_batch(it).tolist() == [4096] * 4
    doc = rec.take_step()
    assert doc["batches"] == 1 and doc["data_wait_ms"] >= 4 * 2.0  # four samples of 2 ms
    assert doc["data_cpu_ms"] < doc["data_wait_ms"]  # sleeping is not CPU
    if proc_io():  # /proc/self/io readable (Linux)
        assert doc["rchar"] >= 4 * 4096
    assert doc["loaders"] == [{"num_workers": 0, "prefetch_factor": None, "batch_size": 4, "pin_memory": False,
                               "persistent_workers": False}]
    assert doc["transfers"] is None  # no GPU: nothing wrapped, summarised as zero
    again = rec.take_step()
    assert again["batches"] == 0 and again["data_wait_ms"] == 0.0  # a new step starts from zero


def test_loader_workers_are_found_and_their_prefetch_depth_kept(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(4096 * 8))
    rec = IoRecorder(gpu=False)
    loader = DataLoader(FileSamples(path), batch_size=2, num_workers=1, prefetch_factor=3)
    it, next_batch = wrapped_loader(rec, loader)
    for _ in range(4):
        next_batch(it)
    doc = rec.take_step()
    assert doc["loaders"][0]["num_workers"] == 1 and doc["loaders"][0]["prefetch_factor"] == 3
    assert len(rec.workers) == 1 and doc["batches"] == 4
    if proc_io():
        assert doc["worker_rchar"] >= 8 * 4096  # the worker read the samples, not the rank
    del it


def test_what_a_new_worker_prefetched_before_the_recorder_looked_counts(tmp_path, monkeypatch):
    """A worker the iterator just started prefetches at once; the recorder may first look at it only after that
    (a loaded machine): its reads still belong to the step. Forced here: the recorder's first look at a worker
    is 0.5 s late, by which time the worker has prefetched 6 of the 8 samples."""
    from cocoweave.cluster.profiling import io_recorder

    if not proc_io():
        pytest.skip("/proc/<pid>/io is not readable here")
    seen: set[int] = set()

    def late(pid: int | None = None) -> dict[str, int]:
        if pid is not None and pid not in seen:
            seen.add(pid)
            time.sleep(0.5)
        return proc_io(pid)

    monkeypatch.setattr(io_recorder, "proc_io", late)
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(4096 * 8))
    rec = IoRecorder(gpu=False)
    it, next_batch = wrapped_loader(rec, DataLoader(FileSamples(path), batch_size=2, num_workers=1,
                                                    prefetch_factor=3))
    for _ in range(4):
        next_batch(it)
    assert rec.take_step()["worker_rchar"] >= 8 * 4096
    del it


def test_a_checkpoint_is_timed_with_the_bytes_written(tmp_path):
    rec = IoRecorder(gpu=False)
    save = rec.timed_checkpoint("torch.save", torch.save)
    load = rec.timed_checkpoint("torch.load", torch.load)
    state = {"w": torch.zeros(256, 1024)}  # 1 MiB
    save(state, tmp_path / "c.pt")
    assert load(tmp_path / "c.pt")["w"].shape == (256, 1024)
    (label, ms, nbytes), (label2, _, read) = rec.take_step()["checkpoints"]
    assert label == "torch.save" and label2 == "torch.load" and ms > 0
    size = (tmp_path / "c.pt").stat().st_size
    if proc_io():
        assert nbytes == pytest.approx(size, rel=0.01) and read >= size


def test_a_nested_save_counts_once():
    rec = IoRecorder(gpu=False)
    inner = rec.timed_checkpoint("torch.save", lambda *a, **k: None)
    outer = rec.timed_checkpoint("cocoweave.checkpoint.save", lambda: inner())
    outer()
    assert [c[0] for c in rec.take_step()["checkpoints"]] == ["cocoweave.checkpoint.save"]


def step(io):
    return {"io": io}


def test_a_world_summary_and_the_checkpoint_the_planner_uses():
    base = {"data_wait_ms": 40.0, "data_cpu_ms": 38.0, "worker_cpu_ms": 0.0, "batches": 1, "read_bytes": 0,
            "rchar": 2e6, "loaders": [{"num_workers": 0, "prefetch_factor": None}], "workers_alive": 0,
            "checkpoints": [], "transfers": None}
    rank0 = [step(base | {"checkpoints": [["torch.save", 100.0, 4e6]]}), step(base), step(base)]
    rank1 = [step(base | {"data_wait_ms": 60.0}), step(base | {"checkpoints": [["torch.save", 300.0, 4e6]]}),
             step(base | {"data_wait_ms": 60.0})]
    io = summarise_io([rank0[1:], rank1[1:]], [rank0, rank1])
    assert io["data_wait_ms"] == pytest.approx((40 + 50) / 2)  # per-rank medians, averaged
    assert io["transfers"]["ms"] == 0.0 and io["transfers"]["note"] == NO_GPU_NOTE
    saves = io["checkpoints"]["torch.save"]
    assert saves["count"] == 2 and saves["mb_per_s"] == pytest.approx(8 / 0.4) and saves["slowest_rank_ms"] == 300
    assert measured_checkpoint(io) == (0.3, 8e6, "torch.save")  # the slowest rank; both ranks' bytes
    assert measured_checkpoint({"checkpoints": {"torch.load": saves}}) is None  # loads are no checkpoint
    assert input_hint(io) == "raise num_workers from 0, or pre-tokenise; a rank reads 2.0 MB per step"
    assert checkpoint_stats([[], []]) == {}


def test_copies_between_devices_are_counted_with_their_bytes_and_said_once_per_step():
    # The meta device stands in for a GPU here: a copy to it changes the device type as .cuda() would.
    rec = IoRecorder(gpu=True)
    to = rec.timed_transfer(torch.Tensor.to)
    to(torch.ones(256), "meta")
    to(torch.ones(4, 8, dtype=torch.float64), "meta", non_blocking=True)
    to(torch.ones(3), torch.float64)  # a dtype change on the host is no transfer
    doc = rec.take_step()
    assert doc["transfers"]["count"] == 2 and doc["transfers"]["bytes"] == 256 * 4 + 32 * 8
    assert doc["transfers"]["async"] == 1 and doc["transfers"]["pinned"] == 0
    assert rec.take_step()["transfers"]["count"] == 0  # counted per step
    base = {"data_wait_ms": 1.0, "checkpoints": [], "transfers": doc["transfers"]}
    io = summarise_io([[step(base), step(base)]], [[step(base), step(base)]])
    assert io["transfers"]["device"] == "gpu" and io["transfers"]["bytes"] == 1280
    assert transfer_sentence(io).startswith("host-device copies: 2 per step, 0.00 MB in ")
    assert transfer_sentence({"transfers": {"device": "cpu"}}) is None  # no GPU: nothing to say
