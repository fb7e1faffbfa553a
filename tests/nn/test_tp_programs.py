"""The tensor-parallel layers as cocoweave programs: every schedule of every layer program equals the program as
written (reference and torch backends, tp 1-4, token counts that do not divide), and a TransformerBlock on every
schedule (sequence parallelism included) computes what the single-process ReferenceBlock computes, forward and
backward, with the same dropout masks."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.errors import ParallelConfigError, ProgramError
from cocoweave.ir import Program, Replicated
from cocoweave.ir.ops import dropout
from cocoweave.nn import ReferenceBlock, TransformerBlock
from cocoweave.nn import programs as P
from cocoweave.nn.compiled import ASYNC, ASYNC_SHM, schedules
from cocoweave.nn.functional import part
from cocoweave.sharding import local

TOL = 2e-5
BLOCK_SCHEDULES = [None, "auto", "MM-AR@shm-C", "MM-RS@shm-C-AG@shm", "MM-fuse(RS-C-AG)@shm", "MM-AR-C", ASYNC,
                   ASYNC_SHM]


@st.composite
def layer_programs(draw):
    """One of the layers' programs at small, possibly uneven sizes."""
    rows, d_in, d_out = draw(st.integers(1, 9)), draw(st.integers(4, 8)), draw(st.integers(4, 8))
    drop, bias, sp = draw(st.sampled_from([0.0, 0.25])), draw(st.booleans()), draw(st.booleans())
    kind = draw(st.sampled_from(["row_forward", "row_backward", "column_backward", "column_forward_sp",
                                 "grad_all_reduce"]))
    if kind == "row_forward":
        return P.row_forward(rows, d_in, d_out, "float32", drop, bias, draw(st.booleans()), sp)
    if kind == "row_backward":
        return P.row_backward(rows, d_in, d_out, "float32", drop, bias, sp)
    if kind == "column_backward":
        return P.column_backward(rows, d_in, d_out, "float32", bias, sp)
    if kind == "column_forward_sp":
        return P.column_forward_sp(rows, d_in, d_out, "float32")
    return P.grad_all_reduce(rows, d_in, "float32", sp)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=layer_programs(), world_size=st.integers(1, 4), seed=st.integers(0, 50))
def test_every_schedule_of_a_layer_program_equals_the_program(program, world_size, seed):
    rows = check_schedules(program, schedules(program), world_size, seed=seed)
    bad = [(r.schedule, r.max_abs, r.error) for r in rows if not r.ok]
    assert not bad, f"{program}\n{bad}"


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=layer_programs(), seed=st.integers(0, 50))
def test_every_schedule_of_a_layer_program_equals_the_program_on_live_ranks(local_world, program, seed):
    rows = check_schedules(program, schedules(program), 2, seed=seed,
                           batch=torch_runner(local_world(2), kernels="torch"))
    bad = [(r.schedule, r.max_abs, r.error) for r in rows if not r.ok]
    assert not bad, f"{program}\n{bad}"


def test_dropout_offset_is_added_to_the_logical_index_and_must_be_a_runtime_integer():
    p = Program("offset")
    x = p.tensor("x", (3, 4), "float32", Replicated)
    seed, offset = p.scalar("seed", "int64"), p.scalar("offset", "int64")
    p.output(dropout(x, 0.5, seed=seed, offset=offset), "out")
    from cocoweave import rng
    from cocoweave.backends import reference

    t = torch.randn(3, 4)
    got = reference.run(p, [{"x": t, "seed": 11, "offset": 7}], {})[0].outputs["out"]
    want = rng.dropout(t, torch.arange(7, 19).reshape(3, 4), 0.5, 11)
    assert torch.equal(got, want)
    with pytest.raises(ProgramError, match="offset must be a runtime integer"):
        dropout(x, 0.5, seed=3, offset=offset)


def block_case(rank: int, world_size: int, schedule: str | None, sp: bool, batch: int, seq: int,
               kernels: str = "torch") -> dict[str, float | str]:
    """A TransformerBlock on `schedule` (sequence-parallel or not) against ReferenceBlock: output, input gradient
    and every parameter gradient (this rank's part), dropout on, at a data-parallel index offset."""
    old = os.environ.get("COCOWEAVE_KERNELS")
    os.environ["COCOWEAVE_KERNELS"] = kernels
    try:
        torch.manual_seed(1)
        ref = ReferenceBlock(16, 4, dropout=0.2, seed=3)
        x = torch.randn(batch, seq, 16)
        xr = x.clone().requires_grad_(True)
        y_ref = ref(xr, step=4, index_offset=192)
        y_ref.square().sum().backward()
        blk = TransformerBlock(16, 4, dropout=0.2, schedule=schedule, sequence_parallel=sp).load_reference(ref)
        if sp:  # this rank's token slice in, its slice out (1/tp of the activations)
            xp = part(x.reshape(-1, 16), 0, world_size, rank).clone().requires_grad_(True)
            y = blk(xp, step=4, index_offset=192, batch_shape=(batch, seq))
            want, want_grad = part(y_ref.detach().reshape(-1, 16), 0, world_size, rank), \
                part(xr.grad.reshape(-1, 16), 0, world_size, rank)
        else:
            xp = x.clone().requires_grad_(True)
            y = blk(xp, step=4, index_offset=192)
            want, want_grad = y_ref, xr.grad
        y.square().sum().backward()
        errs: dict[str, float | str] = {"out": (y - want).abs().max().item(),
                                        "x.grad": (xp.grad - want_grad).abs().max().item()}
        for name in ("ln1", "ln2"):
            errs[name] = (local(getattr(blk, name).weight.grad) - getattr(ref, name).weight.grad).abs().max().item()
        for name, dim in (("qkv", 0), ("proj", 1), ("fc1", 0), ("fc2", 1)):
            mine, full = getattr(blk, name), getattr(ref, name)
            errs[name] = (local(mine.weight.grad) - part(full.weight.grad, dim, world_size, rank)).abs().max().item()
            b = full.bias.grad if dim == 1 else part(full.bias.grad, 0, world_size, rank)
            errs[f"{name}.b"] = (local(mine.bias.grad) - b).abs().max().item()
        errs["repr"] = repr(blk)
        return errs
    finally:
        if old is None:
            os.environ.pop("COCOWEAVE_KERNELS")
        else:
            os.environ["COCOWEAVE_KERNELS"] = old


def _assert_close(per_rank: list[dict], what: str) -> None:
    for r, errs in enumerate(per_rank):
        bad = {k: v for k, v in errs.items() if k != "repr" and not v <= TOL}
        assert not bad, f"{what}, rank {r}: {bad}"


def test_every_block_schedule_equals_the_single_process_block(local_world):
    world = local_world(2)
    for schedule in BLOCK_SCHEDULES:
        per_rank = world.run(block_case, schedule, False, 2, 6)
        _assert_close(per_rank, f"schedule {schedule}")
        shown = per_rank[0]["repr"]
        assert ("schedule=as written" in shown) == (schedule is None), shown
        if schedule not in (None, "auto"):
            assert schedule.split("||")[0] in shown, shown  # print(model) shows what each layer runs


@pytest.mark.parametrize("batch,seq", [(2, 6), (1, 5)])  # 5 tokens do not split evenly over 2 or 4 ranks
def test_sequence_parallel_block_equals_the_single_process_block(local_world, world4, batch, seq):
    _assert_close(local_world(2).run(block_case, "auto", True, batch, seq), "sequence parallel, tp 2")
    _assert_close(world4.run(block_case, "MM-RS-C", True, batch, seq), "sequence parallel, tp 4")


def test_block_at_tp_1_and_4(world4):
    _assert_close([block_case(0, 1, "auto", False, 2, 3)], "tp 1")  # no process group at all
    _assert_close(world4.run(block_case, "auto", False, 1, 5), "tp 4")


def async_shm_case(rank: int, world_size: int) -> dict[str, float | str]:
    """block_case on ASYNC_SHM, counting the split all-reduces the column layers' backward posted on shared memory."""
    from cocoweave.backends.torch import shm

    posted = []
    arrive = shm.Posted.arrive

    def counted(self: shm.Posted) -> None:
        posted.append(self.numel)
        arrive(self)

    shm.Posted.arrive = counted
    try:
        errs = block_case(rank, world_size, ASYNC_SHM, False, 2, 5)
    finally:
        shm.Posted.arrive = arrive
    return {**errs, "posted": str(len(posted))}


@pytest.mark.parametrize("tp", [2, 4])
def test_the_shared_memory_async_input_gradient_reduction_runs_and_equals_the_single_process_block(local_world,
                                                                                                  tp):
    """MM-AR@shm||MMw: the qkv and fc1 backward reduce their input gradient through shm.Posted (one each per
    backward), the weight gradient computed between arrive and finish, and the block still computes what
    ReferenceBlock does."""
    per_rank = local_world(tp).run(async_shm_case)
    _assert_close([{k: v for k, v in errs.items() if k != "posted"} for errs in per_rank], f"ASYNC_SHM, tp {tp}")
    assert all(errs["posted"] == "2" for errs in per_rank), [errs["posted"] for errs in per_rank]
    assert f"backward: {ASYNC_SHM}" in per_rank[0]["repr"]


def test_block_compiled_draws_the_reference_masks(local_world):
    """The CPU default: every fused stage (the epilogue's dropout hash with its runtime offset) one compiled loop."""
    _assert_close(local_world(2).run(block_case, "MM-RS@shm-C", True, 1, 3, "compiled"), "compiled, tp 2")


def test_bad_schedules_and_sequence_parallel_inputs_get_a_sentence():
    with pytest.raises(ParallelConfigError, match="schedule must be"):
        TransformerBlock(16, 4, schedule=3)
    blk = TransformerBlock(16, 4, sequence_parallel=True)
    with pytest.raises(ParallelConfigError, match="needs batch_shape"):
        blk(torch.randn(6, 16))
    with pytest.raises(ParallelConfigError, match="expected \\[6, 16\\]"):
        blk(torch.randn(5, 16), batch_shape=(2, 3))
    with pytest.raises(ParallelConfigError, match="is not available"):
        TransformerBlock(16, 4, schedule="no-such-schedule")(torch.randn(1, 2, 16))
    moe = "A2AV-MM-MM-c-MM-A2AV"  # the MoE experts' program as written: not a schedule of these layers
    with pytest.raises(ParallelConfigError, match=f"schedule '{moe}' is not available for the tensor-parallel"):
        TransformerBlock(16, 4, schedule=moe)(torch.randn(1, 2, 16))


def bf16_case(rank: int, world_size: int, schedule: str, sp: bool) -> dict[str, float]:
    """The block in bfloat16 on `schedule` against the single-process block in bfloat16: errors relative to the
    largest value (bf16 keeps 8 bits: a loose tolerance)."""
    old = os.environ.get("COCOWEAVE_KERNELS")
    os.environ["COCOWEAVE_KERNELS"] = "torch"
    try:
        torch.manual_seed(1)
        ref = ReferenceBlock(16, 4, dropout=0.2, seed=3).to(torch.bfloat16)
        x = torch.randn(2, 6, 16, dtype=torch.bfloat16)
        xr = x.clone().requires_grad_(True)
        y_ref = ref(xr, step=1)
        y_ref.float().square().sum().backward()
        blk = TransformerBlock(16, 4, dropout=0.2, schedule=schedule, sequence_parallel=sp,
                               dtype=torch.bfloat16).load_reference(ref)
        if sp:
            xp = part(x.reshape(-1, 16), 0, world_size, rank).clone().requires_grad_(True)
            y = blk(xp, step=1, batch_shape=(2, 6))
            want, want_grad = part(y_ref.detach().reshape(-1, 16), 0, world_size, rank), \
                part(xr.grad.reshape(-1, 16), 0, world_size, rank)
        else:
            xp = x.clone().requires_grad_(True)
            y = blk(xp, step=1)
            want, want_grad = y_ref, xr.grad
        y.float().square().sum().backward()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            a = local(a)
            return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

        return {"out": rel(y, want), "x.grad": rel(xp.grad, want_grad),
                "fc2": rel(blk.fc2.weight.grad, part(ref.fc2.weight.grad, 1, world_size, rank))}
    finally:
        if old is None:
            os.environ.pop("COCOWEAVE_KERNELS")
        else:
            os.environ["COCOWEAVE_KERNELS"] = old


@pytest.mark.parametrize("schedule,sp", [("MM-RS@shm-C-AG@shm", False), ("MM-RS@shm-C", True)])
def test_bfloat16_block_is_close_to_the_single_process_block(local_world, schedule, sp):
    for r, errs in enumerate(local_world(2).run(bf16_case, schedule, sp)):
        assert all(v < 0.05 for v in errs.values()), f"rank {r}: {errs}"
