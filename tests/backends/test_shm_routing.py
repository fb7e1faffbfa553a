"""No shared-memory algorithm off the CPU (its segments are the host's memory): `@shm` schedules are not offered
for CUDA or meta tensors, the optimizers' "auto" and a tuner cache hit never choose one there, and the runtime and
Executable.shared_input leave a tensor that is not on the CPU where it is (the library's collective runs)."""

from __future__ import annotations

import pytest
import torch

import cocoweave as cw
import cocoweave.tune as tune
from cocoweave.backends.torch.executable import Executable
from cocoweave.backends.torch.runtime import RankContext
from cocoweave.errors import OptimizerError
from cocoweave.ir.loader import load_example
from cocoweave.optim.base import resolve_schedule
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules, shm_offered
from cocoweave.schedule.schedule import Schedule


def _adam() -> cw.Program:
    return load_example("adam.py:adam", N=16)


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "meta"])
def test_no_shm_schedule_is_offered_off_the_cpu(device):
    assert not shm_offered(device) and shm_offered("cpu")
    on_cpu = [s.name for s in enumerate_schedules(_adam())]
    off = [s.name for s in enumerate_schedules(_adam(), device)]
    assert any("@shm" in n for n in on_cpu) and not any("@shm" in n for n in off)
    assert off == [n for n in on_cpu if "@shm" not in n]  # everything else is still offered, in the same order


def test_the_optimizers_auto_and_a_cached_shm_choice_stay_off_shm_on_cuda(monkeypatch):
    program = _adam()
    shm_choice = next(s for s in enumerate_schedules(program) if "@shm" in s.name)
    monkeypatch.setattr(tune, "cached_schedule", lambda *a, **k: Schedule(program, shm_choice.steps))
    assert resolve_schedule(program, "auto", 2, set(), "cpu", shared_host=True).name == shm_choice.name
    on_cuda = resolve_schedule(program, "auto", 2, set(), "cuda", shared_host=True)
    assert "@shm" not in on_cuda.name
    with pytest.raises(OptimizerError, match=r"is not available for program .* here"):
        resolve_schedule(program, shm_choice.name, 2, set(), "cuda", shared_host=True)


def test_the_runtime_runs_no_shm_collective_on_a_tensor_off_the_cpu():
    ctx = RankContext(0, 2, {}, torch.device("meta"), {}, "gloo")
    with pytest.warns(RuntimeWarning, match="its tensors are on meta, not in the host's memory"):
        assert ctx._shm_group(None, torch.empty(4, device="meta")) is None  # no process group is even asked


def _shared(rank: int, world_size: int, device: str) -> bool:
    p = cw.Program("rs")
    g = p.tensor("g", (4, 2), "float32", cw.Local)
    p.output(cw.reduce_scatter(g, "sum", 0), "rs")
    s = Schedule(p)
    s.algorithm(s.stages[0], "shm")
    return Executable(lower(s), rank, world_size, {}, device, kernels="torch").shared_input("g") is not None


def test_shared_input_never_moves_a_parameter_off_the_device(local_world):
    world = local_world(2)
    assert world.run(_shared, "cpu") == [True, True]  # on the CPU the operand is placed in the segment
    assert world.run(_shared, "meta") == [False, False]  # elsewhere it stays where it is
