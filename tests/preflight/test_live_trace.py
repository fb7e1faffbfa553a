"""The predicted trace of the layouts the suite trains equals the one recorded from a live step on 4 Gloo ranks:
every point-to-point operation and every covered collective (the stage boundary's, the loss's and
DistributedAdamW's bucket collectives over dp), in the order each rank issues it, with its peer, group, size and
dtype. Pipeline.check() on a built pipeline passes them, and times them with the stage costs and link it is given."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cocoweave.collectives.pricing import Link
from cocoweave.nn import TransformerBlock, parallel_mesh
from cocoweave.nn.pipeline import Pipeline
from cocoweave.optim import DistributedAdamW
from cocoweave.preflight import PipelineJob, compare, predict, preflight, recording
from cocoweave.preflight.optimizer import bucket_collectives

V, D, H, T, BLOCKS = 11, 16, 4, 8, 4
COSTS, LINK = {s: (1.0 + s, 2.0) for s in range(8)}, Link("test", 1e30, 0.25)  # seconds, and a receive's cost


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def live_case(rank: int, world_size: int, tp: int, pp: int, schedule: str, m: int, n: int,
              sp: bool = False) -> dict[str, object]:
    """Build the pipeline, check it, run one step (shapes are inferred on the first), record the second."""
    torch.manual_seed(0)
    mesh = parallel_mesh(tensor_parallel=tp, pipeline_parallel=pp)
    pipe = Pipeline(mesh, n_blocks=BLOCKS,
                    block=lambda i: TransformerBlock(D, H, dropout=0.1, group=mesh.get_group("tp"),
                                                     sequence_parallel=sp, seed=i),
                    first=lambda: nn.Embedding(V, D), last=lambda: nn.Linear(D, V), loss_fn=ce,
                    microbatches=m, schedule=schedule, sequence_parallel=sp)
    dp = mesh.size(0)
    opt = DistributedAdamW(list(pipe.parameters()), process_group=mesh.get_group("dp"))
    report = pipe.check(batch=n // dp, seq=T, optimizer=opt)
    timed = pipe.check(batch=n // dp, seq=T, memory=False, stage_costs=COSTS, link=LINK)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (n // dp, T), generator=g), torch.randint(0, V, (n // dp, T), generator=g)
    for step in range(2):  # shapes are inferred on the first step: record the second
        opt.zero_grad()
        with recording(optimizer=opt) if step else contextlib.nullcontext() as rec:
            pipe.step(x, y, step=step, no_sync=opt.no_sync)
            opt.step()
    return {"ops": rec.trace.ops.get(rank, []), "other": len(rec.other), "checked_rank": list(report.memory),
            "bubble": report.bubble(rank), "timed": timed.timing.makespan, "pp_rank": pipe.pp_rank,
            "optimizer": bucket_collectives(opt),
            "predicted": report.trace.ops[rank]}


@pytest.mark.parametrize("tp,pp,schedule,sp", [(2, 2, "1f1b", False), (2, 2, "gpipe", True), (1, 4, "gpipe", False),
                                               (1, 2, "interleaved1f1b", False), (1, 2, "loopedbfs", False)])
def test_recorded_trace_equals_predicted(world4, tp: int, pp: int, schedule: str, sp: bool) -> None:
    """pp 2 x tp 2 (with and without sequence parallelism), pp 4, pp 2 x dp 2 (interleaved and looped BFS)."""
    m, n = 4, 8
    results = world4.run(live_case, tp, pp, schedule, m, n, sp=sp)
    job = PipelineJob(pp=pp, tp=tp, dp=4 // (tp * pp), schedule=schedule, microbatches=m, n_blocks=BLOCKS,
                      batch=n // (4 // (tp * pp)), seq=T, d_model=D, heads=H, sequence_parallel=sp,
                      optimizer_steps={r["pp_rank"]: r["optimizer"] for r in results})
    predicted = predict(job)
    recorded = predict(job)  # same shape of object; its ops replaced by what the ranks issued
    recorded.ops.clear()
    for rank, r in enumerate(results):
        recorded.ops[rank] = list(r["ops"])
        assert r["checked_rank"] == [rank]
        assert r["predicted"] == predicted.ops[rank]  # Pipeline.check on the rank predicts what the job does
    assert compare(predicted, recorded) == []
    if job.dp == job.tp == 1:  # Pipeline.check passes stated stage costs and a link on to the timing
        timed = preflight(dataclasses.replace(job, stage_costs=COSTS, link=LINK, optimizer_steps=None), ranks=[])
        assert all(r["timed"] == pytest.approx(timed.timing.makespan) for r in results)
        assert timed.timing.makespan > preflight(dataclasses.replace(job, stage_costs=COSTS), ranks=[]).timing.makespan
    if job.dp > 1:  # the optimizer's reduce-scatters and all-gathers were recorded (and matched) on every rank
        for r in results:
            assert {op.kind for op in r["ops"] if op.label == "optimizer"} == {"reduce_scatter", "all_gather"}
    p2p = sum(op.kind in ("send", "recv") for r in results for op in r["ops"])
    assert p2p == 2 * 2 * m * (job.pp * (2 if schedule in ("interleaved1f1b", "loopedbfs") else 1) - 1) * tp * \
        job.dp  # every boundary: a send and a receive, forward and backward, per micro-batch and mesh replica


def test_a_difference_is_named() -> None:
    """compare() is not blind: one operation changed, one dropped."""
    job = PipelineJob(pp=2, tp=2, microbatches=2, n_blocks=2, batch=2, seq=T, d_model=D, schedule="gpipe")
    a, b = predict(job), predict(job)
    op = b.ops[0][0]
    b.ops[0][0] = type(op)(op.kind, op.group, op.peer, op.numel + 1, op.dtype, op.label)
    b.ops[3].pop()
    said = compare(a, b)
    assert said[0].startswith("rank 0, operation 0: predicted send of 64 float32 to rank 2 (0SEND_F0), recorded "
                              "send of 65")
    assert said[1].startswith("rank 3: predicted ")


def hook_case(rank: int, world_size: int) -> str:
    """A pipeline whose schedule is swapped, after construction, for one that would hang: its first step refuses."""
    from cocoweave.errors import PreflightError

    mesh = parallel_mesh(tensor_parallel=2, pipeline_parallel=2)
    pipe = Pipeline(mesh, n_blocks=2, block=lambda i: TransformerBlock(D, H, group=mesh.get_group("tp"), seed=i),
                    first=lambda: nn.Embedding(V, D), last=lambda: nn.Linear(D, V), loss_fn=ce, microbatches=2,
                    pipeline_schedule="gpipe")
    pipe.pipeline_schedule_name = {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1B1", "1F0", "1B0"]}
    x = torch.randint(0, V, (2, T))
    with pytest.raises(PreflightError) as e:
        pipe.step(x, x)
    assert pipe.boundary_messages() == {"forward": 0, "backward": 0}  # refused before any send
    return str(e.value)


def test_the_first_step_runs_the_check(world4) -> None:
    said = world4.run(hook_case)
    assert len(set(said)) == 1 and said[0].startswith("the schedule would wait forever in every step")


def boundary_case(rank: int, world_size: int) -> list[tuple[object, ...]]:
    """PipelineBoundary by hand (dist.send / dist.recv and a tp all-gather), recorded."""
    from cocoweave.nn.pipeline import PipelineBoundary

    mesh = parallel_mesh(tensor_parallel=2, pipeline_parallel=2)
    stage = rank // 2
    boundary = PipelineBoundary(peer=rank + 2 if stage == 0 else rank - 2, group=mesh.get_group("tp"))
    with recording() as rec:
        if stage == 0:
            boundary.send_forward(torch.ones(4, 6))
        else:
            boundary.recv_forward((4, 6))
    return [(op.kind, op.group, op.peer, op.numel, op.dtype) for op in rec.trace.ops.get(rank, [])] + \
        [("other", op.kind, op.group, op.numel) for op in rec.other]


def test_sends_and_receives_by_hand_are_recorded(world4) -> None:
    """Half of 24 values crosses (the sliced boundary), the receiver all-gathers over its tp group (not a covered
    site: listed as other)."""
    got = world4.run(boundary_case)
    assert got[0] == [("send", (0, 1, 2, 3), 2, 12, "float32")]
    assert got[3] == [("recv", (0, 1, 2, 3), 1, 12, "float32"), ("other", "all_gather", (2, 3), 12)]
