"""The step recorder each rank runs under `cocoweave profile`: phases from the hooks' times, the counted step's
FLOPs and bytes, collectives' bytes, the end of the run after warmup + steps, and nothing without the env."""

from __future__ import annotations

import json

import pytest
import torch

from cocoweave.cluster.profiling import recorder
from cocoweave.cluster.profiling.recorder import OpCounter, StepRecorder


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive_step(rec: StepRecorder, clock: Clock, opt: object, data: float, fwd: float, bwd: float, upd: float):
    """One step through the hooks: `data` s before the first module call, `fwd` s of (nested) module calls,
    `bwd` s until optimizer.step, `upd` s inside it."""
    clock.now += data
    rec.module_pre(None, ())
    rec.module_pre(None, ())  # a submodule: not a new forward
    clock.now += fwd
    rec.module_post(None, (), None)
    rec.module_post(None, (), None)
    clock.now += bwd
    rec.optimizer_pre(opt, (), {})
    clock.now += upd
    rec.optimizer_post(opt, (), {})


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_phases_and_the_end_of_the_run(tmp_path):
    clock, exits = Clock(), []
    rec = StepRecorder(tmp_path / "rank0.jsonl", steps=2, warmup=2, clock=clock, exit_process=exits.append)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    for _ in range(3):
        drive_step(rec, clock, opt, 0.001, 0.010, 0.020, 0.004)
    assert exits == []
    drive_step(rec, clock, opt, 0.001, 0.010, 0.020, 0.004)
    assert exits == [0]  # warmup 2 + 2 timed steps: the run ends
    docs = records(tmp_path / "rank0.jsonl")
    assert [d["type"] for d in docs] == ["header", "step", "step", "step", "step", "counts"]
    header, steps = docs[0], docs[1:5]
    assert header["optimizer"] == "torch.optim.sgd.SGD" and header["param_bytes"] == 12
    assert [s["timed"] for s in steps] == [False, False, True, True]
    last = steps[-1]
    assert last["data_ms"] == pytest.approx(1.0) and last["forward_ms"] == pytest.approx(10.0)
    assert last["backward_ms"] == pytest.approx(20.0) and last["update_ms"] == pytest.approx(4.0)
    assert last["wall_ms"] == pytest.approx(35.0)


def test_a_second_optimizer_does_not_end_a_step(tmp_path):
    clock = Clock()
    rec = StepRecorder(tmp_path / "r.jsonl", steps=5, warmup=2, clock=clock, exit_process=lambda code: None)
    main, other = (torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1) for _ in range(2))
    drive_step(rec, clock, main, 0.0, 0.01, 0.01, 0.01)
    rec.optimizer_pre(other, (), {})
    rec.optimizer_post(other, (), {})
    assert [d["type"] for d in records(tmp_path / "r.jsonl")] == ["header", "step"]


def test_op_counter_counts_matmul_flops_and_traffic_but_not_views():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with OpCounter() as counter:
        c = a @ b
        c.t().reshape(-1)  # views move nothing
        (c + 1.0).sum()
    snap = counter.snapshot()
    assert snap["flops"] == 2 * 8 * 16 * 4
    mm = [h for h in snap["histogram"] if h[0] > 0]
    assert mm == [[2 * 8 * 16 * 4, 4 * (8 * 16 + 16 * 4 + 8 * 4), "float32", 1]]
    assert snap["ops"] >= 3 and snap["bytes"] > 4 * (8 * 16 + 16 * 4)


def test_the_counted_step_splits_forward_backward_from_the_update(tmp_path):
    rec = StepRecorder(tmp_path / "r.jsonl", steps=1, warmup=2, exit_process=lambda code: None)
    w = torch.nn.Parameter(torch.randn(16, 16))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):  # the global hooks are not installed here: call them around step() by hand
        (torch.randn(4, 16) @ w).sum().backward()
        rec.optimizer_pre(opt, (), {})
        opt.step()
        rec.optimizer_post(opt, (), {})
    counts = records(tmp_path / "r.jsonl")[-1]
    assert counts["type"] == "counts"
    assert counts["forward_backward"]["flops"] == 2 * (2 * 4 * 16 * 16)  # x @ w, and x^T @ grad for w's grad
    assert counts["update"]["flops"] == 0 and counts["update"]["bytes"] >= 3 * 16 * 16 * 4  # w -= lr * grad


def test_collective_wrapper_records_bytes_and_synchronous_time(tmp_path):
    clock = Clock()
    rec = StepRecorder(tmp_path / "r.jsonl", steps=1, warmup=2, clock=clock)

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        clock.now += 0.003
        return None

    wrapped = rec.collective("all_reduce", fake_all_reduce)
    wrapped(torch.ones(10))
    wrapped(torch.ones(10), async_op=True)
    count, nbytes, ms = rec.collectives["all_reduce/p1"]
    assert (count, nbytes) == (2, 80) and ms == pytest.approx(3.0)  # the async call's time is not its own


def test_nothing_is_installed_without_the_environment(monkeypatch):
    monkeypatch.delenv(recorder.DIR_ENV, raising=False)
    assert recorder.install_from_env() is None
