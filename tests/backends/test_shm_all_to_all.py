"""The shared-memory all_to_all (backends/torch/shm_all_to_all.py) equals torch.distributed.all_to_all_single on live
Gloo ranks: random uneven splits (zeros, a rank sending nothing, calls large enough to grow the slots), dtypes and
row widths, ranks out of step; as the MoE layer uses it in autograd (the backward is the all_to_all with the splits
swapped), blocking and split in start/wait; splits that disagree, a rank that stops answering and a rank that exits
are one BackendError, never a hang; no segment falls back to the library with the same rows."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cocoweave.backends.torch import shm, shm_all_to_all
from cocoweave.errors import BackendError
from cocoweave.launch import LocalWorld
from cocoweave.nn import moe_dispatch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64}


def _rows(rank: int, n: int, width: int, dtype: str, seed: int) -> torch.Tensor:
    """`n` rows of `width` that say where they come from (distinct per rank, call and row)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == "int64":
        return torch.randint(-10**12, 10**12, (n, width), generator=g)
    return torch.randn(n, width, generator=g, dtype=torch.float64).to(DTYPES[dtype])


def _library(x: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


def calls_case(rank: int, world_size: int, calls: list[dict]) -> list[bool]:
    """Each call through shared memory and through the library: whether the rows are equal, bit for bit. A rank
    late by a random few milliseconds before some calls, or between its start and its wait, puts the ranks out of
    step."""
    g = shm.group_for(None)
    assert g is not None, "the ranks of a LocalWorld share this host: the shared-memory route must be taken"
    late = random.Random(rank)
    got = []
    for i, c in enumerate(calls):  # every shared-memory call first: the library's would put the ranks in step
        sends = c["splits"]  # sends[i][j]: rows rank i sends rank j
        ins, outs = sends[rank], [sends[j][rank] for j in range(world_size)]
        x = _rows(rank, sum(ins), c["width"], c["dtype"], i)
        if c["late"] and late.random() < 0.5:
            time.sleep(0.003)
        op = shm_all_to_all.start(g, None, x, ins, outs)
        if c["late"] and late.random() < 0.5:
            time.sleep(0.003)  # between its write and its reads: the others may be at their next call already
        got.append((x, ins, outs, op.wait()))
    same = [y.dtype == x.dtype and torch.equal(y, _library(x, ins, outs)) for x, ins, outs, y in got]
    return same


SPLIT = st.sampled_from([0, 0, 1, 2, 3, 7, 40])
BIG = 3000  # rows: a call of this many (x width x itemsize) outgrows the slots made before it


@st.composite
def _calls(draw: st.DrawFn) -> tuple[int, list[dict]]:
    world_size = draw(st.sampled_from([2, 4]))
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        splits = [[draw(SPLIT) for _ in range(world_size)] for _ in range(world_size)]
        if draw(st.booleans()):
            i, j = draw(st.integers(0, world_size - 1)), draw(st.integers(0, world_size - 1))
            splits[i][j] = BIG
        calls.append({"splits": splits, "width": draw(st.sampled_from([1, 3, 16])),
                      "dtype": draw(st.sampled_from(sorted(DTYPES))), "late": draw(st.booleans())})
    return world_size, calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_calls())
def test_the_shm_all_to_all_equals_all_to_all_single(local_world, case):
    world_size, calls = case
    assert local_world(world_size).run(calls_case, calls) == [[True] * len(calls)] * world_size


def autograd_case(rank: int, world_size: int, sends: list[list[int]], width: int, dtype: str) -> dict:
    """The layer's use: rows out (dispatch), a computation on them, rows back (combine), blocking and as start /
    wait with work in between, through shared memory and through the library: outputs and input gradients."""
    assert moe_dispatch._route(None, torch.device("cpu")) is not None
    ins, outs = sends[rank], [sends[j][rank] for j in range(world_size)]
    x0 = _rows(rank, sum(ins), width, dtype, 7)
    w = torch.randn(width, width, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(x0.dtype)
    found = {}
    for library in (False, True):
        for split in (False, True):
            x = x0.clone().requires_grad_()
            if split:
                buf, pending = moe_dispatch.start_all_to_all(x, ins, outs, None, library=library)
                side = (x * 2).sum()  # work while the rows are in flight
                got = moe_dispatch.wait_all_to_all(buf, pending)
                buf, pending = moe_dispatch.start_all_to_all(torch.tanh(got @ w), outs, ins, None, library=library)
                back = moe_dispatch.wait_all_to_all(buf, pending)
            else:
                got = moe_dispatch.dispatch_all_to_all(x, ins, outs, None, library=library)
                back = moe_dispatch.dispatch_all_to_all(torch.tanh(got @ w), outs, ins, None, library=library)
                side = (x * 2).sum()
            ((back * x0).sum() + side).backward()
            found[library, split] = (got.detach(), back.detach(), x.grad)
    # the reference: torch's own differentiable all_to_all_single
    from torch.distributed.nn.functional import all_to_all_single

    x = x0.clone().requires_grad_()
    got = all_to_all_single(x.new_empty((sum(outs), width)), x, outs, ins)
    mid = torch.tanh(got @ w)
    back = all_to_all_single(mid.new_empty((sum(ins), width)), mid, ins, outs)
    ((back * x0).sum() + (x * 2).sum()).backward()
    found["torch"] = (got.detach(), back.detach(), x.grad)
    return found


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.sampled_from([2, 4]), data=st.data(), width=st.sampled_from([1, 8]),
       dtype=st.sampled_from(["float32", "float64", "bfloat16"]))
def test_as_used_in_autograd_it_equals_the_library_forward_and_backward(local_world, world_size, data, width,
                                                                        dtype):
    sends = [[data.draw(SPLIT) for _ in range(world_size)] for _ in range(world_size)]
    for found in local_world(world_size).run(autograd_case, sends, width, dtype):
        want = found[True, False]  # the library's blocking all_to_all_single
        for key, got in found.items():
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True)), key


def disagree_case(rank: int, world_size: int) -> str:
    """Rank 0 says it sends 2 rows to rank 1, which expects 3 (and the reverse)."""
    g = shm.group_for(None)
    ins, outs = ([1, 2], [1, 2]) if rank == 0 else ([3, 1], [3, 1])
    try:
        shm_all_to_all.all_to_all(g, None, torch.zeros(sum(ins), 4), ins, outs)
    except BackendError as e:
        return str(e)
    return ""


def test_splits_that_disagree_are_one_sentence_on_each_rank(local_world):
    said = local_world(2).run(disagree_case)
    assert said[0] == ("rank 0: rank 1 sends it 48 bytes in a shared-memory all_to_all but it expects 32 (2 rows of "
                       "16 bytes): the ranks' splits disagree")
    assert said[1] == ("rank 1: rank 0 sends it 32 bytes in a shared-memory all_to_all but it expects 48 (3 rows of "
                       "16 bytes): the ranks' splits disagree")
    assert local_world(2).run(calls_case, [{"splits": [[1, 2], [3, 0]], "width": 2, "dtype": "float32",
                                            "late": False}]) == [[True]] * 2  # the group still works


def _stall(rank: int, world_size: int, seconds: float) -> None:
    g = shm.group_for(None)
    shm_all_to_all.all_to_all(g, None, torch.ones(2, 3), [1, 1], [1, 1])
    if rank == 1:
        time.sleep(seconds)
    shm_all_to_all.all_to_all(g, None, torch.ones(2, 3), [1, 1], [1, 1])


def test_a_rank_that_stops_answering_is_named_within_the_timeout(whole_time_scale):
    timeout = 2 * whole_time_scale
    with LocalWorld(2, timeout_s=timeout) as world:  # the process group's timeout bounds the shared-memory wait
        start = time.monotonic()
        with pytest.raises(BackendError, match=rf"shared-memory barrier of ranks \[0, 1\] waited {timeout} s \(the "
                                               r"process group's timeout\) for rank 1"):
            world.run(_stall, 4.0 * timeout)
        assert time.monotonic() - start < 10 * timeout


def _die(rank: int, world_size: int) -> None:
    g = shm.group_for(None)
    x = torch.ones(4, 3)
    buf = moe_dispatch.start_all_to_all(x, [2, 2], [2, 2], None)
    moe_dispatch.wait_all_to_all(*buf)
    if rank == 1:
        import os

        os._exit(3)
    with pytest.raises(BackendError) as e:
        shm_all_to_all.all_to_all(g, None, x, [2, 2], [2, 2])
    assert "rank 0: rank 1 exited while the ranks [0, 1] waited for it in a shared-memory barrier" in str(e.value)


def test_a_rank_that_exits_is_named_at_once_not_after_the_timeout():
    with LocalWorld(2, timeout_s=30) as world:
        start = time.monotonic()
        with pytest.raises(BackendError, match="rank 1 exited"):
            world.run(_die)
        assert time.monotonic() - start < 20


def no_segment_case(rank: int, world_size: int) -> list:
    """Slots made, then no segment can be made any more: a call that outgrows them takes the library's route on
    every rank (the same rows), one that fits stays on shared memory."""
    g = shm.group_for(None)
    small = [{"splits": [[1, 2], [3, 0]], "width": 4, "dtype": "float32", "late": False}] * 2
    first = calls_case(rank, world_size, small)  # both sets of slots made (and grown to their smallest size)

    def refuse(nbytes: int) -> int:
        raise shm.ShmUnavailable("no memory (planted)")

    shm.create = refuse
    big = [{"splits": [[BIG, BIG], [BIG, BIG]], "width": 64, "dtype": "float32", "late": False}]
    after = calls_case(rank, world_size, big + small)
    state = shm_all_to_all._STATES[g.key]
    return [first, after, state.failed_at is not None, state.sets[0].capacity]


def test_no_segment_falls_back_to_the_library_on_every_rank():
    with LocalWorld(2) as world:  # its own world: the planted failure must not reach other tests
        for first, after, failed, capacity in world.run(no_segment_case):
            assert first == [True, True] and after == [True, True, True]
            assert failed and capacity == shm_all_to_all.MIN_SLOT
