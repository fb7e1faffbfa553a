"""The shared-memory collective algorithm: every collective and the point-to-point send through /dev/shm equal
the reference on live ranks (uneven parts, other dims, half types), nothing is left in /dev/shm, a rank that
stops answering is named within the timeout, and ranks that do not share a host fall back to the library."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.results import RankResult
from cocoweave.backends.torch import shm
from cocoweave.backends.torch.executable import Executable
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.equivalence.compare import compare_results
from cocoweave.errors import BackendError
from cocoweave.launch import LocalWorld
from cocoweave.plan import lower
from cocoweave.schedule.schedule import Schedule


def _collectives(n: int, m: int, dtype: str, op: str, dim: int) -> cw.Program:
    p = cw.Program("collectives")
    g = p.tensor("g", (n, m), dtype, cw.Local)
    x = p.tensor("x", (n, m), dtype, cw.Sliced(dim))
    p.output(cw.all_reduce(g, op), "ar")
    p.output(cw.reduce_scatter(g, op, dim), "rs")
    p.output(cw.all_gather(x), "ag")
    return p


def _on_shm(program: cw.Program) -> Schedule:
    s = Schedule(program)
    for stage in [x for x in s.stages if x.kind == "collective"]:
        s.algorithm(stage, "shm")
    return s


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 9), m=st.integers(1, 4), world_size=st.sampled_from([2, 3, 4]),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]), op=st.sampled_from(["sum", "avg", "max"]),
       dim=st.sampled_from([0, 1]))
def test_shm_collectives_equal_the_reference(local_world, n, m, world_size, dtype, op, dim):
    program = _collectives(n, m, dtype, op, dim)
    s = _on_shm(program)
    assert s.name == "AR@shm-RS@shm-AG@shm"
    inputs = make_inputs(program, world_size, {}, seed=n * 11 + m)
    want = reference.run(program, inputs, {}, whole_state=True)
    got = [r[0] for r in local_world(world_size).run(run_schedules, [s], inputs, {})]
    assert compare_results(program, got, want).ok


def _one(kind: str) -> cw.Program:
    p = cw.Program(kind)
    g = p.tensor("g", (6, 3), "float32", cw.Local)
    x = p.tensor("x", (6, 3), "float32", cw.Sliced(0))
    p.output({"ar": lambda: cw.all_reduce(g, "sum"), "rs": lambda: cw.reduce_scatter(g, "sum", 0),
              "ag": lambda: cw.all_gather(x)}[kind](), kind)
    return p


def _repeat(rank: int, world_size: int, program: cw.Program, steps: list, late: list) -> tuple[list, list]:
    """One executable run on each step's inputs in turn; after barrier k this rank stalls late[rank][k] seconds (a
    rank descheduled before it reads the others' slots). Each step's outputs and the barriers it took."""
    stalls = iter(late[rank])
    barrier = shm.ShmGroup.barrier

    def stalling(self: shm.ShmGroup) -> None:
        barrier(self)
        time.sleep(next(stalls, 0.0))

    shm.ShmGroup.barrier = stalling
    try:
        exe = Executable(lower(_on_shm(program)), rank, world_size, {}, "cpu")
        outs, barriers = [], []
        for inputs in steps:
            group = shm.group_for(None)
            before = group.epoch if group is not None else 0
            res = exe.run(dict(inputs[rank]))
            outs.append({n: t.clone() for n, t in res.outputs.items()})
            barriers.append(shm.group_for(None).epoch - before)
        return outs, barriers
    finally:
        shm.ShmGroup.barrier = barrier


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["ar", "rs", "ag"])
def test_a_collective_called_again_and_again_by_ranks_out_of_step_stays_correct(local_world, kind, world_size):
    """A small collective alternates two sets of slots and ends without a barrier: a rank that runs ahead writes a
    set again only after every rank has read it, however late a rank reads (each step equals the reference,
    with ranks stalling between the barrier and their reads), and it costs one barrier (an all-reduce of 3+
    ranks two: its parts are reduced, then read)."""
    program = _one(kind)
    steps = [make_inputs(program, world_size, {}, seed=40 + i) for i in range(8)]
    late = [[0.02 * ((r + k) % world_size == 0) for k in range(40)] for r in range(world_size)]
    per_rank = local_world(world_size).run(_repeat, program, steps, late)
    for i, inputs in enumerate(steps):
        want = reference.run(program, inputs, {}, whole_state=True)
        assert compare_results(program, [RankResult(outs[i], {}) for outs, _ in per_rank], want).ok, f"step {i}"
    want_barriers = 2 if kind == "ar" and world_size > 2 else 1
    assert all(b[1:] == [want_barriers] * (len(steps) - 1) for _, b in per_rank), [b for _, b in per_rank]


def _posted(rank: int, world_size: int, operands: list, late: list) -> tuple[list, int]:
    """Split all-reduces (shm.Posted) called again and again, each operand computed into the slot, ranks stalling
    between arrive and finish in turns and polling `ready` meanwhile (finishing as soon as every rank arrived), with
    a blocking all-reduce of another buffer between them; the results and how many were finished early."""
    import torch

    g = shm.group_for(None)
    posted_slots = g.slots("test-posted", operands[0][0].numel(), torch.float32)
    other = g.slots("test-other", operands[0][0].numel(), torch.float32)
    n = operands[0][0].numel()
    parts = [(i * n // world_size, (i + 1) * n // world_size - i * n // world_size) for i in range(world_size)]
    got, early = [], 0
    for i, xs in enumerate(operands):
        out = torch.empty(n)
        posted = shm.open_all_reduce(g, posted_slots, n, "sum", out)
        posted.slot.copy_(xs[rank].reshape(-1))
        posted.arrive()
        deadline = time.monotonic() + late[rank][i]
        while time.monotonic() < deadline:
            if not posted.done and posted.ready():
                posted.finish()
                early += 1
        got.append(posted.finish().clone())
        blocked = shm.all_reduce(g, other, (xs[rank] * 2).reshape(-1), "sum", parts, torch.empty(n))
        got.append(blocked.clone())
    return got, early


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_split_all_reduce_equals_the_sum_however_late_each_rank_finishes(local_world, world_size):
    """shm.Posted (the TP layers' MM-AR@shm||MMw): every rank's operand computed into its slot, flagged, and the
    reduction finished later, early where every rank had arrived (polling) or waiting for the late: each call
    equals the sum of the operands, step after step, with a blocking all-reduce of the same group between."""
    import torch

    gen = torch.Generator().manual_seed(5)
    operands = [[torch.randn(7, 3, generator=gen) for _ in range(world_size)] for _ in range(10)]
    late = [[0.01 * ((r + k) % world_size == 0) for k in range(10)] for r in range(world_size)]
    per_rank = local_world(world_size).run(_posted, operands, late)
    for i, xs in enumerate(operands):
        want = sum(xs).reshape(-1)
        for got, _ in per_rank:
            assert torch.allclose(got[2 * i], want, atol=1e-6), f"split all-reduce {i}"
            assert torch.allclose(got[2 * i + 1], 2 * want, atol=1e-5), f"blocking all-reduce after {i}"
    assert any(early for _, early in per_rank)  # the stalled ranks saw the others arrive and finished early


def _pipeline() -> cw.Program:
    p = cw.Program("pipe")
    first, second = p.pipeline(2)
    x = p.tensor("x", (5, 3), "float32", cw.Replicated, group=first)
    y = cw.send(x * 2.0, second)
    p.output(y + 1.0, "y")
    return p


def test_shm_send_equals_the_reference_step_after_step(local_world):
    program = _pipeline()
    s = Schedule(program)
    s.algorithm(s.find("send")[0], "shm")
    assert "P2P@shm" in s.name
    inputs = make_inputs(program, 4, {}, seed=3)
    want = reference.run(program, inputs, {}, whole_state=True)
    per_rank = local_world(4).run(run_schedules, [s, s, s], inputs, {})  # three executables, one after the other
    for i in range(3):
        assert compare_results(program, [r[i] for r in per_rank], want).ok


def _leftovers(rank: int, world_size: int) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("cocoweave-*"))


def test_no_segment_outlives_its_mapping(local_world):
    program = _collectives(4, 2, "float32", "sum", 0)
    inputs = make_inputs(program, 2, {}, seed=0)
    world = local_world(2)
    world.run(run_schedules, [_on_shm(program)], inputs, {})
    assert world.run(_leftovers) == [[], []]


def _stall(rank: int, world_size: int, program: cw.Program, inputs: list, seconds: float) -> None:
    exe = Executable(lower(_on_shm(program)), rank, world_size, {}, "cpu")
    exe.run(dict(inputs[rank]))  # both ranks set the segments up
    if rank == 1:
        time.sleep(seconds)
    exe.run(dict(inputs[rank]))


def test_a_rank_that_stops_answering_is_named_within_the_timeout(whole_time_scale):
    program = _collectives(4, 2, "float32", "sum", 0)
    inputs = make_inputs(program, 2, {}, seed=0)
    timeout = 2 * whole_time_scale  # 2 s on the quiet machine
    with LocalWorld(2, timeout_s=timeout) as world:  # the process group's timeout bounds the shared-memory wait
        start = time.monotonic()
        with pytest.raises(BackendError, match=rf"shared-memory barrier of ranks \[0, 1\] waited {timeout} s \(the "
                                               r"process group's timeout\) for rank 1"):
            world.run(_stall, program, inputs, 4.0 * timeout)
        assert time.monotonic() - start < 10 * timeout


def _other_hosts(rank: int, world_size: int, program: cw.Program, inputs: list) -> tuple:
    def unreachable(pid: int, fd: int, nbytes: int) -> int:
        raise FileNotFoundError(2, "No such file or directory")  # what a rank of another host or PID namespace gets

    shm.open_peer = unreachable
    with pytest.warns(RuntimeWarning, match=r"could not open rank 0's segment \(No such file or directory\)"):
        out = run_schedules(rank, world_size, [_on_shm(program)], inputs, {})
    return out[0], dist.get_world_size()


def test_ranks_on_different_hosts_fall_back_to_the_library():
    program = _collectives(6, 2, "float32", "avg", 1)
    inputs = make_inputs(program, 2, {}, seed=1)
    want = reference.run(program, inputs, {}, whole_state=True)
    with LocalWorld(2) as world:  # its own world: the patched opener must not reach other tests
        got = [r[0] for r in world.run(_other_hosts, program, inputs)]
    assert compare_results(program, got, want).ok


def test_a_process_that_exited_is_not_alive_and_a_zombie_neither():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(0.5)  # exited, not reaped yet: a zombie
    assert shm._alive(os.getpid()) and not shm._alive(child.pid)
    child.wait()
    assert not shm._alive(child.pid) and shm._alive(0)


def _die_in_barrier(rank: int, world_size: int, program: cw.Program, inputs: list) -> float:
    exe = Executable(lower(_on_shm(program)), rank, world_size, {}, "cpu")
    exe.run(dict(inputs[rank]))
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        exe.run(dict(inputs[rank]))
    except BackendError as e:
        assert "rank 1 exited while the ranks [0, 1] waited for it" in str(e), str(e)
        return time.monotonic() - start
    return float("inf")


def test_a_rank_that_exits_is_named_at_once_not_after_the_timeout():
    program = _collectives(4, 2, "float32", "sum", 0)
    inputs = make_inputs(program, 2, {}, seed=0)
    with LocalWorld(2, timeout_s=30) as world:
        start = time.monotonic()
        with pytest.raises(BackendError, match="rank 1 exited"):
            world.run(_die_in_barrier, program, inputs)
        assert time.monotonic() - start < 20
