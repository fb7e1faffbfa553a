"""The checker without ranks: good layouts pass with torch's bubble, user-written schedules in torch's action form
are read and checked, and each bad job fails with one sentence naming its ranks, operations and step."""

from __future__ import annotations

import dataclasses

import pytest

from cocoweave.errors import ParallelConfigError, PreflightError
from cocoweave.preflight import Op, PipelineJob, Trace, check_trace, predict, preflight, read_schedule_csv

SMALL = {"n_blocks": 4, "batch": 8, "seq": 8, "d_model": 16, "heads": 4}


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                             ("interleaved1f1b", 2, 4, 2), ("interleaved1f1b", 4, 8, 2)])
def test_good_layouts_pass_with_the_textbook_bubble(schedule: str, pp: int, m: int, v: int) -> None:
    """Equal stages, a backward twice a forward: the simulated idle share is (p - 1) / (v m + p - 1)."""
    job = PipelineJob(pp=pp, microbatches=m, schedule=schedule, **SMALL | {"n_blocks": 2 * pp * v, "batch": m})
    report = preflight(job)
    for r in report.trace.ranks:
        assert report.bubble(r) == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_1f1b_holds_fewer_microbatches_than_gpipe() -> None:
    """Activations in flight on the first stage: pp for 1F1B, every micro-batch for GPipe."""
    one = preflight(PipelineJob(pp=4, microbatches=8, schedule="1f1b", **SMALL | {"batch": 8}))
    gp = preflight(PipelineJob(pp=4, microbatches=8, schedule="gpipe", **SMALL | {"batch": 8}))
    assert [one.memory[r].in_flight for r in range(4)] == [4, 3, 2, 1]
    assert [gp.memory[r].in_flight for r in range(4)] == [8] * 4
    assert one.memory[0].activations * 2 == gp.memory[0].activations


def test_a_user_schedule_in_torch_csv_form_is_the_named_one(tmp_path) -> None:
    """torch's own compute-only action rows for interleaved 1F1B, written as CSV and read back, predict the same
    trace as the schedule by name."""
    named = PipelineJob(pp=2, microbatches=4, schedule="interleaved1f1b", **SMALL)
    from torch.distributed.pipelining import schedules as S

    from cocoweave.preflight.predict import _Recorder, _StubStage

    rec = _Recorder(named, 0, Trace())
    torch_sch = S.ScheduleInterleaved1F1B([_StubStage(rec, s, 4, 0, 1) for s in (0, 2)], 4,
                                          loss_fn=lambda *a: None)
    rows = [",".join(str(a) for a in torch_sch.pipeline_order[r] if a is not None and a.is_compute_op)
            for r in range(2)]
    (tmp_path / "s.csv").write_text("\n".join(rows) + "\n")
    custom = PipelineJob(pp=2, microbatches=4, schedule=read_schedule_csv(tmp_path / "s.csv"), **SMALL)
    assert predict(custom).ops == predict(named).ops
    assert preflight(custom).timing.max_bubble == pytest.approx(1 / 9)


def test_two_stages_both_receiving_first_would_hang() -> None:
    """A compute+comms schedule where stage 0 waits for a gradient before it sends its activation."""
    rows = {0: ["0F0", "0RECV_B0", "0B0", "0SEND_F0"], 1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]}
    job = PipelineJob(pp=2, microbatches=1, schedule=rows, schedule_format="compute_comms",
                      **SMALL | {"batch": 1})
    with pytest.raises(PreflightError) as e:
        preflight(job)
    assert str(e.value) == (
        "ranks 0 and 1 would wait for each other forever in step 0: rank 0 waits on its recv of 128 float32 from "
        "rank 1 (0RECV_B0) (event 2) for rank 1; rank 1 waits on its recv of 128 float32 from rank 0 (1RECV_F0) "
        "(event 1) for rank 0")


def test_a_compute_only_schedule_with_no_order_would_hang() -> None:
    """Stage 0 waits for the gradient of micro-batch 0 before sending micro-batch 1, which stage 1 runs first."""
    rows = {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1B1", "1F0", "1B0"]}
    job = PipelineJob(pp=2, microbatches=2, schedule=rows, **SMALL | {"batch": 2})
    with pytest.raises(PreflightError, match="the schedule would wait forever in every step: torch's lowering"):
        preflight(job)


def test_a_computation_before_its_receive_is_named() -> None:
    rows = {0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0"], 1: ["1F0", "1RECV_F0", "1B0", "1SEND_B0"]}
    job = PipelineJob(pp=2, microbatches=1, schedule=rows, schedule_format="compute_comms", **SMALL | {"batch": 1})
    with pytest.raises(PreflightError, match=r"^rank 1 \(pipeline rank 1\) would stop in training step 0: torch's "
                                             r"runtime says Computing action=1F0 before receiving input"):
        preflight(job)


def test_fewer_microbatches_than_stages_is_refused() -> None:
    with pytest.raises(ParallelConfigError, match=r"schedule '1f1b' needs at least as many micro-batches as "
                                                  r"pipeline ranks \(4\), got 2"):
        preflight(PipelineJob(pp=4, microbatches=2, schedule="1f1b", **SMALL))


@pytest.mark.parametrize("split,said", [
    ([3, 2], "the stage split [3, 2] does not match the model: the schedule runs 2 stages, which must hold the 4 "
             "blocks, at least one each"),
    ([4, 0], "the stage split [4, 0] does not match the model"),
    ([1, 1, 2], "the stage split [1, 1, 2] does not match the model: the schedule runs 2 stages"),
])
def test_a_stage_split_that_does_not_match_the_model(split: list[int], said: str) -> None:
    with pytest.raises(ParallelConfigError) as e:
        preflight(PipelineJob(pp=2, microbatches=4, stage_split=split, **SMALL))
    assert str(e.value).startswith(said)


def test_a_schedule_that_places_stages_unlike_the_pipeline() -> None:
    """Stage 1 on rank 0 and stage 0 on rank 1: not where Pipeline builds them."""
    rows = {0: ["1F0", "1B0"], 1: ["0F0", "0B0"]}
    with pytest.raises(ParallelConfigError, match=r"stage split does not match the model: it puts stages on pipeline "
                                                  r"ranks \[1, 0\]"):
        preflight(PipelineJob(pp=2, microbatches=1, schedule=rows, **SMALL | {"batch": 1}))


def test_a_layout_that_does_not_fit_names_the_term() -> None:
    job = PipelineJob(pp=2, microbatches=4, schedule="gpipe", block_params=10_000_000, **SMALL)
    need = preflight(job).memory[0].total
    job.device_memory = need * 0.9
    with pytest.raises(PreflightError) as e:
        preflight(job)
    said = str(e.value)
    assert said.startswith("rank 0 would need 0.373 GiB in step 0 (weights 0.0745, gradients 0.0745, optimizer "
                           "0.149, activations 0.000134, buffers 0.0745, programs 1.14e-05 GiB), 0.0373 GiB more than "
                           "its device's "
                           "0.335 GiB; the largest term is the optimizer state (0.149 GiB)")  # 2 x 1e7 fp32, Adam
    job.device_memory = need * 1.01
    assert preflight(job).memory[0].total == need


def test_activations_in_flight_that_do_not_fit_are_named() -> None:
    """GPipe keeps all 16 micro-batches of a long sequence; 1F1B only pp of them, and fits the same device."""
    big = SMALL | {"seq": 2048, "d_model": 256, "batch": 16, "heads": 8}
    gpipe = PipelineJob(pp=2, microbatches=16, schedule="gpipe", device_memory=2**30, **big)
    with pytest.raises(PreflightError, match=r"the largest term is the activations of 16 micro-batch stages in "
                                             r"flight \("):
        preflight(gpipe)
    one = PipelineJob(pp=2, microbatches=16, schedule="1f1b", device_memory=2**30, **big)
    assert preflight(one).memory[0].in_flight == 2


def _two_rank_trace(first: list[Op], second: list[Op]) -> Trace:
    t = Trace(step=7)
    for rank, ops in ((0, first), (1, second)):
        for op in ops:
            if op.kind in ("send", "recv"):
                t.wait(rank, t.post(rank, [op]))
            else:
                t.collective(rank, op)
    return t


AR = Op("all_reduce", (0, 1), None, 4, "float32", "grads")
AG = Op("all_gather", (0, 1), None, 8, "float32", "params")


def test_a_group_entered_in_different_orders_is_named() -> None:
    with pytest.raises(PreflightError) as e:
        check_trace(_two_rank_trace([AR, AG], [AG, AR]))
    assert str(e.value) == ("in step 7, ranks 0 and 1 enter group [0, 1] in different orders: its collective 0 is "
                            "rank 0's all_reduce of 4 float32 over ranks [0, 1] (grads) but rank 1's all_gather of 8 "
                            "float32 over ranks [0, 1] (params); both would wait forever")


def test_groups_entered_in_a_circle_are_named() -> None:
    """Four ranks, two groups each, every group's order the same on its members: the circle is across groups."""
    pp = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    dp = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    t = Trace(step=2)
    order = {0: "pp dp", 1: "dp pp", 2: "dp pp", 3: "pp dp"}
    for r, seq in order.items():
        for g in seq.split():
            t.collective(r, Op("all_reduce", (pp if g == "pp" else dp)[r], None, 1, "float64", f"loss over {g}"))
    with pytest.raises(PreflightError) as e:
        check_trace(t)
    assert str(e.value).startswith("ranks 0, 1, 3 and 2 would wait for each other forever in step 2: rank 0 waits "
                                   "in its all_reduce of 1 float64 over ranks [0, 1] (loss over pp) (event 0) for "
                                   "rank 1; rank 1 waits in its all_reduce of 1 float64 over ranks [1, 3]")
    order[1], order[2] = "pp dp", "pp dp"  # every rank pp first: no circle
    t = Trace()
    for r, seq in order.items():
        for g in seq.split():
            t.collective(r, Op("all_reduce", (pp if g == "pp" else dp)[r], None, 1, "float64", f"loss over {g}"))
    check_trace(t)


def test_a_send_without_its_receive_and_a_size_mismatch_are_named() -> None:
    send = Op("send", (0, 1), 1, 64, "float32", "0SEND_F0")
    with pytest.raises(PreflightError) as e:
        check_trace(_two_rank_trace([send, send], [Op("recv", (0, 1), 0, 64, "float32", "1RECV_F0")]))
    assert str(e.value) == ("in step 7, rank 0's send of 64 float32 to rank 1 (0SEND_F0) at its event 2 has no "
                            "matching receive on rank 1, which posts 1 receives from rank 0 for 2 sends; rank 0 "
                            "would wait forever")
    with pytest.raises(PreflightError) as e:
        check_trace(_two_rank_trace([send], [Op("recv", (0, 1), 0, 32, "float32", "1RECV_F0")]))
    assert str(e.value) == ("in step 7, rank 0's send of 64 float32 to rank 1 (0SEND_F0) is received by rank 1's "
                            "recv of 32 float32 from rank 0 (1RECV_F0): 64 float32 sent, 32 float32 expected")


@pytest.mark.parametrize("field,value,said", [
    ("microbatches", 0, "microbatches must be a positive integer, got 0"),
    ("batch", 6, "a batch of 6 samples cannot be split into 4 equal micro-batches"),
    ("dtype", "int8", "dtype 'int8' is not one of float32"),
    ("schedule", "zigzag", "unknown pipeline schedule 'zigzag'"),
])
def test_bad_input_is_one_sentence(field: str, value: object, said: str) -> None:
    job = PipelineJob(pp=2, microbatches=4, **SMALL)
    setattr(job, field, value)
    with pytest.raises(ParallelConfigError, match=said):
        preflight(job)


@pytest.mark.parametrize("blocks,stages", [(4, 2), (7, 4), (5, 4), (9, 2)])
def test_the_default_split_is_the_pipelines(blocks: int, stages: int) -> None:
    from cocoweave.nn.pipeline import stage_blocks
    from cocoweave.preflight.predict import stage_split

    job = PipelineJob(pp=stages, microbatches=stages, **SMALL | {"n_blocks": blocks})
    assert stage_split(job, stages) == [len(stage_blocks(blocks, stages, s)) for s in range(stages)]


def test_fewer_blocks_than_stages_is_one_sentence() -> None:
    with pytest.raises(ParallelConfigError, match=r"^3 blocks cannot be cut into 4 pipeline stages"):
        preflight(PipelineJob(pp=4, microbatches=4, **SMALL | {"n_blocks": 3}))


@pytest.mark.parametrize("rank1,said", [
    (["1RECV_F0", "1F0", "1B0", "1SEND_B0"], "rank 1's schedule never reduces stage 1's gradients in step 0"),
    (["1RECV_F0", "1F0", "1REDUCE_GRAD", "1B0", "1SEND_B0"],
     "rank 1's schedule reduces stage 1's gradients before its backward 1B0 in step 0 (1REDUCE_GRAD must follow "
     "the stage's last backward): a data-parallel stage would step on gradients its replicas never summed"),
    (["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1REDUCE_GRAD"], None),
])
def test_a_backward_that_bypasses_the_gradient_reduction(rank1: list[str], said: str | None) -> None:
    """pytorch #144530's trap in a written-out schedule: the reduction missing, or before the last backward."""
    rows = {0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0REDUCE_GRAD"], 1: rank1}
    job = PipelineJob(pp=2, microbatches=1, schedule=rows, schedule_format="compute_comms", **SMALL | {"batch": 1})
    if said is None:
        preflight(job)
        return
    with pytest.raises(PreflightError) as e:
        preflight(job)
    assert str(e.value).startswith(said)


def test_one_replica_is_the_whole_jobs_verdict_at_a_fraction_of_the_cost() -> None:
    """The check step() runs: one dp x tp replica's pipeline, whose bubble is the whole job's."""
    import time

    job = PipelineJob(pp=4, tp=4, dp=16, microbatches=8, schedule="interleaved1f1b", **SMALL | {"n_blocks": 8})
    t = time.perf_counter()
    whole = preflight(job, ranks=[])
    t_whole, t = time.perf_counter() - t, time.perf_counter()
    one = preflight(job, ranks=[], one_replica=True)
    t_one = time.perf_counter() - t
    assert one.trace.ranks == [0, 1, 2, 3] and len(whole.trace.ranks) == 256
    assert one.timing.max_bubble == pytest.approx(whole.timing.max_bubble)
    assert t_one < t_whole, (t_one, t_whole)  # the work: 4 ranks simulated instead of 256
    rows = {0: ["0F0", "0RECV_B0", "0B0", "0SEND_F0"], 1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]}
    hangs = PipelineJob(pp=2, dp=4, tp=2, microbatches=1, schedule=rows, schedule_format="compute_comms",
                        **SMALL | {"batch": 1})
    with pytest.raises(PreflightError, match="^ranks 0 and 1 would wait for each other forever"):
        preflight(hangs, ranks=[], one_replica=True)


@pytest.mark.parametrize("m", [2, 4])
def test_stage_costs_replace_the_unit_costs(m: int) -> None:
    """GPipe on 2 stages, the second twice as slow (forward 1 and 2, backward 2 and 4): rank 1 computes 6m of a
    step of 3 + 6m (rank 0's first forward before it, rank 0's last backward after it), rank 0 3m of it."""
    job = PipelineJob(pp=2, microbatches=m, schedule="gpipe", stage_costs={0: (1.0, 2.0), 1: (2.0, 4.0)},
                      **SMALL | {"batch": m})
    report = preflight(job)
    assert report.timing.makespan == pytest.approx(3 + 6 * m)
    assert report.bubble(0) == pytest.approx(1 - 3 * m / (3 + 6 * m))
    assert report.bubble(1) == pytest.approx(3 / (3 + 6 * m))


@pytest.mark.parametrize("m", [2, 4])
def test_a_link_costs_each_receiver_its_messages(m: int) -> None:
    """GPipe on 2 stages, forward 1 s and backward 2 s, each message costing its receiver c = 0.25 s (the link's
    latency; its bandwidth too large to count): stage 1's forwards and stage 0's backwards each wait for the
    other rank and then pay c, so the step is 3 + 3m + 2mc, of which rank 0 computes 3m and rank 1 3m."""
    from cocoweave.collectives.pricing import Link

    c = 0.25
    job = PipelineJob(pp=2, microbatches=m, schedule="gpipe", stage_costs={0: (1.0, 2.0), 1: (1.0, 2.0)},
                      link=Link("test", 1e30, c), **SMALL | {"batch": m})
    report = preflight(job)
    assert report.timing.makespan == pytest.approx(3 + 3 * m + 2 * m * c)
    assert report.bubble(0) == pytest.approx(1 - 3 * m / (3 + 3 * m + 2 * m * c))
    assert report.bubble(1) == pytest.approx(1 - 3 * m / (3 + 3 * m + 2 * m * c))
    free = preflight(dataclasses.replace(job, link=None))
    assert free.timing.makespan == pytest.approx(3 + 3 * m)  # no link: communication is free
    with pytest.raises(ParallelConfigError, match="^a link prices each receive in seconds: state the stages' costs"):
        preflight(dataclasses.replace(job, stage_costs=None))  # seconds beside block units: refused


def test_activations_count_the_stage_outputs_kept_for_backward() -> None:
    """GPipe, 2 stages of 2 blocks, 4 micro-batches: at the peak (every forward done) stage 0 holds its blocks'
    activations and the 4 outputs torch keeps for their backward (and sends); the last stage sends nothing."""
    from cocoweave.preflight.memory import layer_activation

    job = PipelineJob(pp=2, microbatches=4, schedule="gpipe", **SMALL)
    report = preflight(job)
    blocks = 4 * 2 * layer_activation(job)
    assert report.memory[0].activations == pytest.approx(blocks + 4 * job.boundary_numel() * 4)
    assert report.memory[1].activations == pytest.approx(blocks)
