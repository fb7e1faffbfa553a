"""Ranks of a tensor-parallel group that build a layer differently (schedule= "auto" on one and as written on the
other, another d_model) are refused on every rank at construction, with a sentence naming two ranks and what
differs, instead of hanging or aborting inside torch at the first step; the world stays usable."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocoweave.errors import ParallelConfigError
from cocoweave.nn import TransformerBlock


def _build(rank: int, world_size: int, how: str) -> str:
    d, schedule = 32, "auto"
    if rank == 1 and how == "schedule":
        schedule = None
    if rank == 1 and how == "d_model":
        d = 48
    try:
        TransformerBlock(d, 4, dropout=0.0, schedule=schedule)
        said = "built"
    except ParallelConfigError as exc:
        said = str(exc)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is still usable
    return f"{said} | {t.item():g}"


def test_ranks_building_a_layer_differently_are_refused_together(local_world):
    assert local_world(2).run(_build, "same") == ["built | 2"] * 2
    for how, part in (("schedule", "schedule: rank 0 has 'auto', rank 1 has 'None'"),
                      ("d_model", "in_features: rank 0 has '32', rank 1 has '48'")):
        said = local_world(2).run(_build, how)
        assert all(s.startswith("ranks disagree on a tensor-parallel layer") and part in s and s.endswith("| 2")
                   for s in said), said


def _pipeline(rank: int, world_size: int, how: str) -> str:
    from torch import nn

    from cocoweave.nn import Pipeline, parallel_mesh

    mesh = parallel_mesh(pipeline_parallel=2)
    schedule = "gpipe" if rank == 1 and how == "schedule" else "1f1b"
    microbatches = 2 if rank == 1 and how == "microbatches" else 4
    try:
        Pipeline(mesh, n_blocks=2, block=lambda i: nn.Linear(4, 4), loss_fn=nn.functional.mse_loss,
                 microbatches=microbatches, pipeline_schedule=schedule)
        return "built"
    except ParallelConfigError as exc:
        return str(exc)


def test_ranks_building_a_pipeline_differently_are_refused_together(local_world):
    assert local_world(2).run(_pipeline, "same") == ["built"] * 2
    for how, part in (("schedule", "schedule: rank 0 has '1f1b', rank 1 has 'gpipe'"),
                      ("microbatches", "microbatches: rank 0 has '4', rank 1 has '2'")):
        said = local_world(2).run(_pipeline, how)
        assert all(s.startswith("ranks disagree on a pipeline") and part in s for s in said), said
