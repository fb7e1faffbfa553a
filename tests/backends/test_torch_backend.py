"""The torch.distributed backend against the reference: every schedule of every example at world sizes
1 to 4 on live Gloo ranks; the ring algorithms on random sizes; mismatched, hung and dead ranks give a
clear error within the timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.results import RankResult
from cocoweave.backends.torch.worker import run_and_time, run_schedules
from cocoweave.equivalence.check import check_schedules, torch_runner, world_applicable
from cocoweave.equivalence.compare import compare_results
from cocoweave.errors import BackendError
from cocoweave.ir.loader import load_example
from cocoweave.launch import LocalWorld
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule

# sizes that do not divide by 3 or 4, so that parts are uneven and some chunks are empty
EXAMPLES = [("adam.py:adam", {"N": 13}), ("lamb.py:lamb", {"N": 13}),
            ("model_parallel.py:layer", {"B": 3, "S": 4, "H": 8}),
            ("pipeline_parallel.py:boundary", {"B": 2, "S": 5, "H": 8})]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("spec, sizes", EXAMPLES, ids=[e[0].split(".")[0] for e in EXAMPLES])
def test_every_schedule_of_every_example_equals_the_reference(local_world, spec, sizes, world_size):
    program = load_example(spec, **sizes)
    if world_applicable(program, world_size) is not None:
        pytest.skip(world_applicable(program, world_size))
    schedules = enumerate_schedules(program)
    assert any("@ring" in s.name for s in schedules)  # the algorithm variants are among them
    rows = check_schedules(program, schedules, world_size, {}, seed=world_size,
                           batch=torch_runner(local_world(world_size)))
    bad = [r for r in rows if not r.ok]
    assert len(rows) == len(schedules) and not bad, bad


def _ring_program(n: int, m: int, op: str) -> cw.Program:
    p = cw.Program("ring")
    g = p.tensor("g", (n, m), "float32", cw.Local)
    w = p.tensor("w", (n, m), "float32", cw.Replicated)
    b = p.tensor("b", (m,), "float32", cw.Replicated)
    (lr,) = p.scalars("lr")
    y = cw.all_reduce(g, op)
    p.update(w, w - lr * cw.dropout(y + b, 0.25, seed=3))
    p.output(y * 2.0, "y")
    return p


def _ring_schedules(program: cw.Program) -> list[Schedule]:
    """The AllReduce on the ring, and split + reorder + fuse(RS-C-AG) on the fused ring."""
    on_ring = Schedule(program)
    on_ring.algorithm(on_ring.find("all_reduce")[0], "ring")
    fused = Schedule(program)
    _, ag = fused.split(fused.find("all_reduce")[0])
    fused.reorder(ag)
    stage = fused.fuse(*fused.stages)  # RS, C and the AllGathers of w and y
    fused.algorithm(stage, "ring")
    return [on_ring, fused]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 11), m=st.integers(1, 3), world_size=st.sampled_from([2, 3, 4]),
       op=st.sampled_from(["sum", "avg", "max", "min"]))
def test_ring_algorithms_equal_the_reference(local_world, n, m, world_size, op):
    program = _ring_program(n, m, op)
    schedules = _ring_schedules(program)
    assert [s.name for s in schedules] == ["AR@ring-c", "fuse(RS-C-AG)@ring"]
    inputs = make_inputs(program, world_size, {}, seed=n * 7 + m)
    expected = reference.run(program, inputs, {}, whole_state=True)
    per_rank = local_world(world_size).run(run_schedules, schedules, inputs, {})
    for i, s in enumerate(schedules):
        d = compare_results(program, [r[i] for r in per_rank], expected)
        assert d.ok, (s.name, d)


def test_run_and_time_traces_chunks_on_compute_and_comm_tracks(local_world):
    program = load_example("model_parallel.py:layer", B=4, S=2, H=8)
    s = next(x for x in enumerate_schedules(program) if x.name == "ol(MM,AR,C,4)")
    inputs = make_inputs(program, 2, {}, seed=0)
    per_rank = local_world(2).run(run_and_time, s, inputs, {}, "cpu", 3, True)
    assert all(len(r["times_ms"]) == 3 and min(r["times_ms"]) > 0 for r in per_rank)
    events = per_rank[1]["events"]
    chunks = {(e["stream"], e["name"], e["chunk"]) for e in events if e["chunk"] is not None}
    assert {("compute", "MM", k) for k in range(4)} <= chunks and {("comm", "AR", k) for k in range(4)} <= chunks
    assert all(e["rank"] == 1 and e["dur_ns"] >= 0 for e in events)
    want = reference.run(s, inputs, {}, whole_state=True)
    assert compare_results(program, [r["result"] for r in per_rank], want).ok


def _run_rank_dependent(rank: int, world_size: int, schedules: list[Schedule], inputs: list, sizes: dict) -> list:
    """A buggy launcher: each rank runs a different schedule."""
    return run_schedules(rank, world_size, [schedules[rank % len(schedules)]], inputs, sizes)


def test_ranks_running_different_plans_fail_at_start(local_world):
    program = load_example("adam.py:adam", N=8)
    schedules = enumerate_schedules(program)[:2]
    world = local_world(2)
    with pytest.raises(BackendError, match="ranks disagree on the plan to run") as info:
        world.run(_run_rank_dependent, schedules, make_inputs(program, 2, {}), {})
    assert (f"they differ first in the schedule: rank 0 has '{schedules[0].name}', rank 1 has "
            f"'{schedules[1].name}'") in str(info.value)  # what differs, not only two fingerprints
    assert world.broken is None  # nothing was left half-done: the world keeps working


def _stall_or_die(rank: int, world_size: int, how: str, schedule: Schedule, inputs: list, hang_s: float = 60.0) -> list:
    if rank == 1 and how == "hang":
        time.sleep(hang_s)
    if rank == 1 and how == "die":
        os._exit(7)
    return run_schedules(rank, world_size, [schedule], inputs, {})


def test_a_hung_or_dead_rank_is_a_clear_error_within_the_timeout(time_scale):
    program = load_example("adam.py:adam", N=8)
    schedule = enumerate_schedules(program)[0]
    inputs = make_inputs(program, 2, {})
    timeout = 5 * time_scale  # 5 s on the quiet machine
    with LocalWorld(2, timeout_s=timeout) as world:
        start = time.monotonic()
        with pytest.raises(BackendError, match=r"rank.* (did not finish|failed).*") as hung:
            world.run(_stall_or_die, "hang", schedule, inputs, 12 * timeout)
        assert time.monotonic() - start < 4 * timeout
        assert "Traceback" not in str(hung.value) and "\n" not in str(hung.value)
        world.restart()
        with pytest.raises(BackendError, match="rank 1 exited with code 7"):
            world.run(_stall_or_die, "die", schedule, inputs)


def _compiled_step(rank: int, world_size: int, schedule: Schedule, inputs: list) -> dict:
    """A user's own torch.distributed program: compile once, call twice (buffers are reused)."""
    exe = cw.compile(schedule, backend="torch", device="cpu")
    first = {k: v.clone() for k, v in exe(dict(inputs[rank])).outputs.items()}
    buffers = {k: b.data_ptr() for k, b in exe.ctx.buffers.items()}
    second = exe(dict(inputs[rank])).outputs
    same = {k: b.data_ptr() for k, b in exe.ctx.buffers.items()} == buffers
    return {"first": first, "second": {k: v.clone() for k, v in second.items()}, "same_buffers": same,
            "source": exe.source}


def test_compile_runs_inside_an_existing_torch_distributed_program(local_world):
    program = load_example("model_parallel.py:layer", B=2, S=3, H=8)
    s = next(x for x in enumerate_schedules(program) if x.name == "MM-fuse(RS-C-AG)@ring")
    inputs = make_inputs(program, 2, {}, seed=5)
    per_rank = local_world(2).run(_compiled_step, s, inputs)
    want = reference.run(s, inputs, {})
    for r, res in enumerate(per_rank):
        assert res["same_buffers"] and "ctx.fused_ring(" in res["source"]
        torch.testing.assert_close(res["first"]["out"], want[r].outputs["out"])
        torch.testing.assert_close(res["second"]["out"], res["first"]["out"])


@pytest.mark.parametrize("spec, sizes", EXAMPLES[:3], ids=[e[0].split(".")[0] for e in EXAMPLES[:3]])
def test_one_rank_runs_every_schedule_without_a_process_group(spec, sizes):
    """cw.compile at world size 1 in a plain process (no init_process_group): collectives are identities."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    program = load_example(spec, **sizes)
    inputs = make_inputs(program, 1, sizes, seed=5)
    expected = reference.run(program, inputs, sizes, whole_state=True)
    for s in enumerate_schedules(program):
        exe = cw.compile(s, backend="torch", sizes=sizes, device="cpu", rank=0, world_size=1)
        given = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs[0].items()}
        res = exe.run(given)
        state = {n: (exe.kept[n] if n in exe.plan.sliced_state else t) for n, t in res.state.items()}
        got = [RankResult(dict(res.outputs), state)]
        assert compare_results(program, got, expected).ok, s.name


def test_an_output_naming_a_state_input_is_its_value_before_the_update():
    """`output old = s` beside `s' = update(s, ...)`: the result is s as given, on every schedule (the step
    writes new state in place, so the generated code must keep the old value)."""
    p = cw.Program("state_output")
    s = p.tensor("s", (7,), "float32", cw.Replicated)
    g = p.tensor("g", (7,), "float32", cw.Local)
    p.update(s, s * 2.0 + cw.all_reduce(g, "sum"))
    p.output(s, "old")
    inputs = make_inputs(p, 1, {}, seed=3)
    expected = reference.run(p, inputs, {}, whole_state=True)
    for sched in enumerate_schedules(p):
        exe = cw.compile(sched, backend="torch", device="cpu", rank=0, world_size=1)
        given = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs[0].items()}
        res = exe.run(given)
        assert torch.equal(res.outputs["old"], inputs[0]["s"]), sched.name
        state = {n: (exe.kept[n] if n in exe.plan.sliced_state else t) for n, t in res.state.items()}
        assert compare_results(p, [RankResult(dict(res.outputs), state)], expected).ok, sched.name


def test_nccl_averages_in_the_collective_and_gloo_divides_after():
    import torch.distributed as dist

    from cocoweave.backends.torch.runtime import RankContext

    x, ids = torch.ones(4), torch.ones(4, dtype=torch.int64)
    assert RankContext(0, 2, {}, torch.device("cpu"), {}, "nccl")._reduce_op("avg", x) == (dist.ReduceOp.AVG, False)
    assert RankContext(0, 2, {}, torch.device("cpu"), {}, "nccl")._reduce_op("avg", ids) == (dist.ReduceOp.SUM, True)
    mixed = RankContext(0, 2, {}, torch.device("cpu"), {}, "cpu:gloo,cuda:nccl")
    assert mixed._reduce_op("avg", x) == (dist.ReduceOp.SUM, True)  # a CPU tensor goes to Gloo, which has no AVG
    assert RankContext(0, 2, {}, torch.device("cpu"), {}, "gloo")._reduce_op("sum", x) == (dist.ReduceOp.SUM, False)
