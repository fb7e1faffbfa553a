"""all_to_all with runtime splits (`cw.all_to_all(x, dim, splits=, recv=, rows=)`, the kind all_to_all_v): on the
reference backend and on the torch backend (the library's all_to_all_single and the shared-memory algorithm) over
Gloo ranks, against torch.distributed.all_to_all_single itself: uneven splits with zeros (a rank sending nothing,
a rank receiving nothing), float32 and bfloat16, rows along dim 0 or 1, a receive capacity above the rows
received; dispatch then combine (the adjoint: the counts swapped) gives each rank its rows back; on a mesh along one
axis; the layouts it refuses and counts that disagree."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.errors import InputError, ProgramError
from cocoweave.schedule.schedule import Schedule


def _program(world: int, dim: int, width: int, rows: int | str | None, back: bool = False,
             dtype: str = "float32") -> cw.Program:
    """x (N rows along `dim`) Local; its rows exchanged by the runtime counts s (sent) and r (received), scaled;
    with `back`, exchanged again with the counts swapped (combine)."""
    p = cw.Program("a2av")
    shape = ("N", width) if dim == 0 else (width, "N")
    x = p.tensor("x", shape, dtype, cw.Local)
    s = p.tensor("s", (world,), "int64", cw.Local)
    r = p.tensor("r", (world,), "int64", cw.Local)
    y = cw.all_to_all(x, dim, splits=s, recv=r, rows=rows) * 2.0
    if back:
        y = cw.all_to_all(y, dim, splits=r, recv=s, rows="N")
    p.output(y, "y")
    return p


def _inputs(sends: list[list[int]], n: int, width: int, dim: int, seed: int, dtype: str = "float32") -> list[dict]:
    world = len(sends)
    g = torch.Generator().manual_seed(seed)
    ins = []
    for i in range(world):
        x = torch.randn(n, width, generator=g).to(getattr(torch, dtype))
        ins.append({"x": x if dim == 0 else x.T.contiguous(), "s": torch.tensor(sends[i]),
                    "r": torch.tensor([sends[j][i] for j in range(world)])})
    return ins


def _library(rank: int, world: int, ins: list[dict], dim: int, rows: int) -> torch.Tensor:
    """What torch.distributed.all_to_all_single gives this rank, padded with zero rows to `rows`."""
    x, s, r = ins[rank]["x"].movedim(dim, 0), ins[rank]["s"].tolist(), ins[rank]["r"].tolist()
    got = x.new_empty((sum(r), *x.shape[1:]))
    dist.all_to_all_single(got, x[:sum(s)].contiguous(), r, s)
    out = torch.cat([got, got.new_zeros((rows - sum(r), *x.shape[1:]))])
    return out.movedim(0, dim) * 2.0


def _torch_case(rank: int, world: int, program: cw.Program, ins: list[dict], sizes: dict, dim: int, rows: int
                ) -> list[torch.Tensor]:
    """On this rank: the program as written (library), on the shared-memory algorithm, and the library call."""
    shm = Schedule(program)
    shm.algorithm(shm.find("all_to_all_v")[0], "shm")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the shared-memory route taken, not the library's instead
        got = run_schedules(rank, world, [Schedule(program), shm], ins, sizes)
    return [g.outputs["y"] for g in got] + [_library(rank, world, ins, dim, rows)]


@st.composite
def cases(draw, world: int):
    """A world x world matrix of row counts with zeros (whole rows or columns of them at times), row widths, the
    rows' dimension and a receive capacity at or above the most rows any rank receives."""
    zero = draw(st.sampled_from(["none", "sender", "receiver", "random"]))
    sends = [[draw(st.integers(0, 5)) for _ in range(world)] for _ in range(world)]
    if zero == "sender":
        sends[draw(st.integers(0, world - 1))] = [0] * world
    elif zero == "receiver":
        j = draw(st.integers(0, world - 1))
        for row in sends:
            row[j] = 0
    elif zero == "random":
        sends = [[k if draw(st.booleans()) else 0 for k in row] for row in sends]
    n = max(sum(row) for row in sends) + draw(st.integers(0, 2))  # rows past the splits are not sent
    need = max(sum(sends[i][j] for i in range(world)) for j in range(world))
    rows = draw(st.sampled_from([None, need + draw(st.integers(0, 3))])) if need <= n else need
    return sends, n, draw(st.integers(1, 4)), draw(st.sampled_from([0, 1])), rows, draw(st.integers(0, 99))


def _expected(sends: list[list[int]], ins: list[dict], dim: int, rows: int) -> list[torch.Tensor]:
    """Rank j's rows: from each rank i in order, the splits_i[j] rows after those it sends ranks 0..j-1."""
    world, out = len(sends), []
    for j in range(world):
        pieces = [ins[i]["x"].narrow(dim, sum(sends[i][:j]), sends[i][j]) for i in range(world)]
        got = torch.cat(pieces, dim)
        pad = list(got.shape)
        pad[dim] = rows - got.shape[dim]
        out.append(torch.cat([got, got.new_zeros(pad)], dim))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(world=st.integers(1, 4), data=st.data())
def test_the_reference_sends_each_ranks_rows_where_its_splits_say(world, data):
    sends, n, width, dim, rows, seed = data.draw(cases(world))
    p = _program(world, dim, width, rows)
    ins = _inputs(sends, n, width, dim, seed)
    res = reference.run(p, ins, {"N": n})
    for j, want in enumerate(_expected(sends, ins, dim, rows if rows is not None else n)):
        assert torch.equal(res[j].outputs["y"], want * 2.0)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_then_combine_with_the_counts_swapped_gives_each_rank_its_rows(world):
    sends = [[(i + 2 * j) % 3 for j in range(world)] for i in range(world)]
    sends[0] = [0] * world  # a rank that sends nothing
    n = max(sum(r) for r in sends) + 1
    ins = _inputs(sends, n, 3, 0, world)
    res = reference.run(_program(world, 0, 3, world * 3, back=True), ins, {"N": n})
    for i in range(world):
        k = sum(sends[i])
        assert torch.equal(res[i].outputs["y"][:k], ins[i]["x"][:k] * 2.0)
        assert not res[i].outputs["y"][k:].any()


@pytest.mark.parametrize("world", [2, 4])
def test_the_torch_backend_equals_the_reference_and_all_to_all_single(local_world, world):
    w = local_world(world)

    @settings(max_examples=8 if world == 2 else 5, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        sends, n, width, dim, rows, seed = data.draw(cases(world))
        dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
        p = _program(world, dim, width, rows, dtype=dtype)
        ins = _inputs(sends, n, width, dim, seed, dtype)
        want = reference.run(p, ins, {"N": n})
        got = w.run(_torch_case, p, ins, {"N": n}, dim, rows if rows is not None else n)
        for j in range(world):
            library, shm, single = got[j]
            assert torch.equal(want[j].outputs["y"], single), (sends, j)
            assert torch.equal(library, single) and torch.equal(shm, single), (sends, j)

    check()


def test_the_torch_backend_runs_dispatch_and_combine_on_a_mesh_axis(local_world):
    p = cw.Program("a2av_mesh")
    p.mesh(ep=2, dp=2)
    x = p.tensor("x", (6, 3), "float32", cw.Layout(ep=cw.Local, dp=cw.Local))
    s = p.tensor("s", (2,), "int64", cw.Layout(ep=cw.Local, dp=cw.Local))
    r = p.tensor("r", (2,), "int64", cw.Layout(ep=cw.Local, dp=cw.Local))
    y = cw.all_to_all(x, 0, axis="ep", splits=s, recv=r, rows=12) + 1.0
    p.output(cw.all_to_all(y, 0, axis="ep", splits=r, recv=s, rows=6), "y")
    # ranks (ep, dp) = divmod(rank, 2): the ep line through rank d is {d, 2 + d}
    sends = {0: [2, 3], 1: [0, 4], 2: [1, 0], 3: [5, 1]}
    ins = []
    for rank in range(4):
        e, d = divmod(rank, 2)
        peer = (1 - e) * 2 + d
        recv = [sends[rank][e], sends[peer][e]] if e == 0 else [sends[peer][e], sends[rank][e]]
        ins.append({"x": torch.randn(6, 3), "s": torch.tensor(sends[rank]), "r": torch.tensor(recv)})
    want = reference.run(p, ins)
    for rank in range(4):
        k = sum(sends[rank])
        assert torch.equal(want[rank].outputs["y"][:k], ins[rank]["x"][:k] + 1.0)
    got = local_world(4).run(run_schedules, [Schedule(p)], ins, {})
    for rank in range(4):
        assert torch.equal(got[rank][0].outputs["y"], want[rank].outputs["y"])


def test_layouts_and_counts_it_refuses():
    p = cw.Program("t")
    s = p.tensor("s", (2,), "int64", cw.Local)
    r = p.tensor("r", (2,), "int64", cw.Local)
    with pytest.raises(ProgramError, match="needs a Local operand.*a Sliced operand moves with the static form"):
        cw.all_to_all(p.tensor("a", (4, 2), "float32", cw.Sliced(1)), 0, splits=s, recv=r)
    with pytest.raises(ProgramError, match="needs a Local operand.*Replicated operand"):
        cw.all_to_all(p.tensor("b", (4, 2), "float32"), 0, splits=s, recv=r)
    x = p.tensor("x", (4, 2), "float32", cw.Local)
    with pytest.raises(ProgramError, match="int32 or int64 tensor, not float32"):
        cw.all_to_all(x, 0, splits=p.tensor("f", (2,), "float32", cw.Local), recv=r)
    with pytest.raises(ProgramError, match="`recv` must be an integer tensor"):
        cw.all_to_all(x, 0, splits=s)
    with pytest.raises(ProgramError, match="runtime splits= take none"):
        cw.all_to_all(x, 0, shares=(1, 1), splits=s, recv=r)
    with pytest.raises(ProgramError, match="rows .the receive capacity. must be a non-negative int"):
        cw.all_to_all(x, 0, splits=s, recv=r, rows=-1)
    m = cw.Program("m")
    m.mesh(ep=2, dp=2)
    xm = m.tensor("x", (4, 2), "float32", cw.Layout(ep=cw.Local, dp=cw.Sliced(0)))
    sm = m.tensor("s", (3,), "int64", cw.Layout(ep=cw.Local, dp=cw.Local))
    with pytest.raises(ProgramError, match="rows dimension 0 is sliced along axis `dp`"):
        cw.all_to_all(xm, 0, axis="ep", splits=sm, recv=sm)
    xl = m.tensor("y", (4, 2), "float32", cw.Layout(ep=cw.Local, dp=cw.Local))
    with pytest.raises(ProgramError, match="holds 3 counts on each rank; the axis has 2 ranks"):
        cw.all_to_all(xl, 0, axis="ep", splits=sm, recv=sm)


def test_counts_that_disagree_or_do_not_fit_are_one_sentence():
    p = _program(2, 0, 2, 4)
    ins = _inputs([[1, 1], [2, 0]], 3, 2, 0, 0)
    ins[1]["r"] = torch.tensor([1, 1])  # rank 1 expects one row from rank 1, which sends it none
    with pytest.raises(InputError, match=r"rank 1 expects \[1, 1\] rows from the ranks but they send it \[1, 0\]"):
        reference.run(p, ins, {"N": 3})
    ins = _inputs([[3, 1], [2, 0]], 3, 2, 0, 0)
    with pytest.raises(InputError, match="splits \\[3, 1\\] sum to 4 rows but it holds 3"):
        reference.run(p, ins, {"N": 3})
    ins = _inputs([[2, 1], [3, 0]], 3, 2, 0, 0)
    with pytest.raises(InputError, match="receives 5 rows but the result holds 4"):
        reference.run(p, ins, {"N": 3})


def test_the_tuner_prices_it_as_the_even_all_to_all_of_its_operand():
    """The splits are unknown when a schedule is priced: its comm term is (p-1)/p of the operand's bytes (every row
    the operand holds sent, the most it can move), priced on its own calibrated line (calibration times its library
    call)."""
    from cocoweave import collectives
    from cocoweave.perf.costmodel import AlphaBeta, Calibration, predict_plan
    from cocoweave.plan import lower

    assert collectives.kind("all_to_all_v").benchmark is not None
    p = _program(4, 0, 8, 40)
    cal = Calibration("gloo", "cpu", 4, {"all_reduce/library": AlphaBeta(0.0, 1000.0),
                                         "all_to_all_v/library": AlphaBeta(0.5, 2.0)}, {}, {})
    pred = predict_plan(lower(Schedule(p)), {"N": 10}, 4, cal)
    mb = 10 * 8 * 4 * 3 / 4 / 1e6
    assert pred.features["comm_mb"] == pytest.approx(mb)
    assert pred.features["comm_ms"] == pytest.approx(0.5 + 2.0 * mb)


def test_every_enumerated_schedule_equals_the_program_as_written(local_world):
    """Enumeration offers it on the library and, on CPUs, shared memory; it chunks no exchange -> computation ->
    exchange chain without a GEMM to overlap (row-set chunks are for dispatch -> expert GEMMs -> combine,
    tests/schedule/test_row_chunks.py): each schedule gives the reference's rows on live ranks."""
    from cocoweave.schedule.enumerate import enumerate_schedules

    p = _program(2, 0, 3, 9, back=True)
    found = enumerate_schedules(p)
    assert any("shm" in str(s) for s in found) and not any("overlap" in str(s).lower() for s in found)
    ins = _inputs([[1, 3], [0, 4]], 5, 3, 0, 7)
    want = reference.run(p, ins, {"N": 5})
    got = local_world(2).run(run_schedules, found, ins, {"N": 5})
    for r in range(2):
        for k in range(len(found)):
            assert torch.equal(got[r][k].outputs["y"], want[r].outputs["y"]), found[k]


@pytest.mark.parametrize("world", [2, 4])
def test_random_inputs_draw_counts_that_agree_so_the_equivalence_checks_run(local_world, world):
    """make_inputs draws counts that agree (and fit) for all_to_all_v's count inputs, zeros included, so
    check_schedules compares every enumerated schedule of a dispatch -> compute -> combine program with the program
    as written, on the reference and on live Gloo ranks."""
    from cocoweave.backends.inputs import make_inputs
    from cocoweave.equivalence.check import check_schedules, torch_runner
    from cocoweave.schedule.enumerate import enumerate_schedules

    p = _program(world, 0, 3, "M", back=True)
    sizes = {"N": 5, "M": 4 * world}
    zeros = 0
    for seed in range(6):
        ins = make_inputs(p, world, sizes, seed=seed)
        for j in range(world):
            assert ins[j]["r"].tolist() == [ins[i]["s"][j].item() for i in range(world)]
            zeros += ins[j]["s"].tolist().count(0)
        reference.run(p, ins, sizes)  # the counts fit: no InputError
    assert zeros > 0
    found = enumerate_schedules(p)
    for seed in range(3):
        assert all(row.ok for row in check_schedules(p, found, world, sizes, seed=seed))
    rows = check_schedules(p, found, world, sizes, seed=1, batch=torch_runner(local_world(world)))
    assert len(rows) == len(found) and all(row.ok for row in rows), rows


def _wrong_receive_buffer(rank: int, world: int) -> str:
    from cocoweave.backends.torch import shm, shm_all_to_all
    from cocoweave.errors import BackendError

    x = torch.ones(3, 2)
    try:
        shm_all_to_all.start(shm.group_for(None), None, x, [1, 2], [1, 2], out=torch.empty(4, 2))
    except BackendError as e:
        return str(e)
    return ""


def test_a_shared_memory_receive_buffer_of_the_wrong_shape_is_one_sentence(local_world):
    """all_to_all_v on the shm algorithm receives straight into its result (`out=`); a buffer that cannot hold the
    rows is refused before any rank writes."""
    got = local_world(2).run(_wrong_receive_buffer)
    assert all("receive buffer must be contiguous torch.float32 of shape (3, 2), got torch.float32 (4, 2)" in m
               for m in got), got


def test_a_receive_capacity_named_by_a_size_is_one_of_the_programs_sizes():
    """`rows="M"` names a size no input has: the program lists it (the CLI's -s M=..., bound_sizes) and a run that
    leaves it unbound is one InputError naming it."""
    p = _program(2, 0, 3, "M", back=True)
    assert p.size_names() == ["N", "M"]
    ins = _inputs([[1, 1], [0, 2]], 3, 3, 0, 0)
    with pytest.raises(InputError, match="size M is not bound"):
        reference.run(p, ins, {"N": 3})
    assert reference.run(p, ins, {"N": 3, "M": 4})[1].outputs["y"].shape == (3, 3)
