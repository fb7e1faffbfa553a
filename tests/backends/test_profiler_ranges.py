"""Each stage of a step shows up in torch.profiler (and in Nsight under emit_nvtx) as a `record_function` range
named after the stage, while a profiler runs; the step's results are the same with or without it."""

from __future__ import annotations

import torch

from cocoweave.backends.torch.executable import Executable
from cocoweave.ir.loader import load_example
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules


def _inputs(w: torch.Tensor) -> dict:
    return {"g": torch.ones(8), "w": w, "m": torch.zeros(8), "v": torch.zeros(8), "lr": 0.1, "beta1": 0.9,
            "beta2": 0.99, "eps": 1e-8, "step": 1.0}


def test_stages_are_named_ranges_in_the_profilers_trace():
    schedule = next(s for s in enumerate_schedules(load_example("adam.py:adam", N=8)) if s.name == "AR-C")
    exe = Executable(lower(schedule), 0, 1, {}, "cpu", kernels="torch")
    plain, profiled = torch.ones(8), torch.ones(8)
    exe.run(_inputs(plain))
    with torch.profiler.profile() as prof:
        exe.run(_inputs(profiled))
    names = [e.name for e in prof.events() if e.name.startswith("cocoweave ")]
    assert names == [f"cocoweave {i}:{stage.label}" for i, stage in enumerate(exe.plan.stages)] == \
        ["cocoweave 0:AR", "cocoweave 1:C"]
    assert torch.equal(plain, profiled)
