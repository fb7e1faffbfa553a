"""The plain PyTorch baselines run on live ranks, each named, and a torch.compile'd one compiles once per world."""

from __future__ import annotations

import torch

from cocoweave.demo.baselines import BASELINES, PARAMS, adam_step
from cocoweave.launch import rank_state

SIZES = {"adam": {"N": 4 * PARAMS}, "model_parallel": {"B": 2, "S": 4, "H": 8},
         "pipeline_parallel": {"B": 2, "S": 4, "H": 8}}


def every_baseline(rank: int, world_size: int) -> dict[str, list[float]]:
    return {b.name: b.run(rank, world_size, SIZES[key], 2, 1, "float32") for key, bs in BASELINES.items() for b in bs}


def compiled_twice(rank: int, world_size: int) -> int:
    compiled = next(b for b in BASELINES["model_parallel"] if "compile" in b.name)
    for _ in range(2):
        compiled.run(rank, world_size, SIZES["model_parallel"], 1, 1, "float32")
    return len(rank_state()["demo_compiled_epilogues"])


def test_every_baseline_runs_and_is_named_for_the_table(local_world):
    names = [b.name for bs in BASELINES.values() for b in bs]
    assert len(set(names)) == len(names) == 6
    assert any("Adam(fused=True)" in n for n in names) and any("ZeroRedundancyOptimizer" in n for n in names)
    assert sum("torch.compile'd" in n for n in names) == 2 and sum("eager" in n for n in names) == 2
    for per_rank in (local_world(2).run(every_baseline), local_world(4).run(every_baseline)):
        for times in per_rank:
            assert set(times) == set(names)
            assert all(len(t) == 2 and all(x > 0 for x in t) for t in times.values())


def test_a_compiled_epilogue_compiles_once_per_world(local_world):
    assert local_world(2).run(compiled_twice) == [1, 1]


def zero_minus_fused(rank: int, world_size: int) -> tuple[float, float]:
    """The largest difference between the parameters of the two Adam baselines after 3 steps, and how far the
    parameters moved."""
    params = {}
    for zero in (False, True):
        step, ps = adam_step(rank, world_size, 64, zero)
        before = torch.cat([p.detach() for p in ps])
        for _ in range(3):
            step()
        params[zero] = torch.cat([p.detach() for p in ps])
    return (params[True] - params[False]).abs().max().item(), (params[True] - before).abs().max().item()


def test_the_zero_baseline_computes_what_the_fused_adam_baseline_computes(local_world):
    for diff, moved in local_world(2).run(zero_minus_fused):
        assert diff < 1e-6 and moved > 1e-4
