"""schedule="auto" measures a layer's choices once and keeps them in the tuning cache: a later run (a new process)
takes the kept choices without measuring, when every rank of the group kept the same; otherwise the ranks measure
together."""

from __future__ import annotations

import os

import torch

from cocoweave.nn import ColumnParallelLinear


def _step(rank: int, world_size: int, cache: str, forget: bool) -> dict:
    """One forward and backward of an "auto" column-parallel layer with this process's memory cleared, the cache at
    `cache` (this rank's own file when it is a folder); how often "auto" measured, and what it chose."""
    from cocoweave import tune
    from cocoweave.nn import compiled

    if os.path.isdir(cache):
        cache = os.path.join(cache, f"rank{rank}.json")
    os.environ["COCOWEAVE_TUNE_CACHE"] = cache
    tune._CHOSEN.clear()
    measured = []
    real = compiled.Programs.fastest

    def counting(self, runs, device):  # noqa: ANN001
        measured.append(len(runs))
        return real(self, runs, device)

    compiled.Programs.fastest = counting
    try:
        torch.manual_seed(0)
        layer = ColumnParallelLinear(64, 96, schedule="auto")
        x = torch.randn(32, 64, requires_grad=True)
        layer(x).square().sum().backward()
        return {"measured": len(measured), "chosen": layer.schedule}
    finally:
        compiled.Programs.fastest = real
        if forget and os.path.exists(cache):
            os.remove(cache)


def test_a_second_run_takes_the_kept_choices_without_measuring(local_world, tmp_path):
    cache = str(tmp_path / "tune-cache.json")
    first = local_world(2).run(_step, cache, False)
    assert all(r["measured"] > 0 for r in first)
    again = local_world(2).run(_step, cache, False)
    assert [r["measured"] for r in again] == [0, 0]
    assert [r["chosen"] for r in again] == [r["chosen"] for r in first]


def test_ranks_that_kept_different_choices_measure_together(local_world, tmp_path):
    folder = tmp_path / "caches"
    folder.mkdir()
    local_world(2).run(_step, str(folder), False)
    os.remove(folder / "rank1.json")  # rank 1 forgot: both measure, neither takes rank 0's alone
    again = local_world(2).run(_step, str(folder), False)
    assert all(r["measured"] > 0 for r in again)
