"""Row-set chunks (schedule/rows.py): a dropless MoE's dispatch -> expert GEMMs -> combine overlapped in K chunks
whose rows every rank derives from its own runtime counts (Comet, MegaScale-MoE). The chunks partition every
segment, the sender's chunk of what it sends rank j is the chunk rank j receives from it, the chunked schedules
equal the program as written on routings with idle experts, silent ranks and segments shorter than K (reference at
1-4 ranks, torch backend at 2 and 4 Gloo ranks), the chains it cannot run are one sentence, and the cost model
prices the stage as a pipeline where its exchanges overlap and in series where they do not (shared memory)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave import workloads
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.errors import InputError, ScheduleError
from cocoweave.ir import Layout, Local, Sliced
from cocoweave.perf.costmodel import AlphaBeta, Calibration, predict_plan
from cocoweave.plan import lower
from cocoweave.schedule import rows as row_sets
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.rows import Chunks
from cocoweave.schedule.schedule import Schedule

D, F = 4, 3


def _chunked(p: cw.Program, chunks: int, shm: bool = False) -> Schedule:
    """`p` with its dispatch -> experts -> combine chain (the first all_to_all_v to the last) in `chunks` chunks."""
    s = Schedule(p)
    names = [x.anchor for x in s.stages]
    a2av = [i for i, x in enumerate(s.stages) if x.label == "A2AV"]
    stage = s.overlap(*names[a2av[0]:a2av[-1] + 1], chunks=chunks)
    if shm:
        s.algorithm(stage, "shm")
    return s


# -- the arithmetic ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data(), ranks=st.integers(1, 4), chunks=st.integers(2, 5), groups=st.integers(1, 3))
def test_chunks_partition_every_segment_and_the_sender_cuts_what_the_receiver_expects(data, ranks, chunks, groups):
    sent = [[data.draw(st.integers(0, 7)) for _ in range(ranks)] for _ in range(ranks)]  # sent[i][j]: i -> j
    for j in range(ranks):
        r = torch.tensor([sent[i][j] for i in range(ranks)])
        c = torch.tensor([[0] * groups for _ in range(ranks)])
        for i in range(ranks):  # rank i's rows for rank j, split among j's groups (idle ones included)
            for _ in range(sent[i][j]):
                c[i, data.draw(st.integers(0, groups - 1))] += 1
        mine = Chunks(chunks, {"r": r}, {"c": (c, "r")}, "test")
        seen = torch.cat([mine.index("r", k) for k in range(chunks)])
        assert sorted(seen.tolist()) == list(range(int(r.sum())))  # every row in exactly one chunk
        assert sum(mine.segments("c", k) for k in range(chunks)).tolist() == c.tolist()
        for k in range(chunks):
            assert mine.segments("c", k).sum(1).tolist() == mine.counts("r", k).tolist()
            assert len(mine.index("r", k)) == mine.rows("r", k) == int(mine.counts("r", k).sum())
            for i in range(ranks):  # what sender i cuts for j in chunk k is what j expects from i in chunk k
                theirs = Chunks(chunks, {"s": torch.tensor(sent[i])}, {}, "test")
                assert int(theirs.counts("s", k)[j]) == int(mine.counts("r", k)[i])


def test_segments_that_do_not_sum_to_the_rows_received_are_one_sentence():
    with pytest.raises(InputError, match="line i summing to the"):
        Chunks(2, {"r": torch.tensor([3, 1])}, {"c": (torch.tensor([[1, 1], [0, 1]]), "r")}, "rank 0: ol")


# -- equivalence --------------------------------------------------------------------------------------------


@st.composite
def routings(draw, world: int):
    """(experts, rows per rank, per-rank inputs) of the dropless program: sent[i][j][e] rows from rank i to rank j's
    local expert e, zeros included (idle experts, a rank that sends nothing, segments shorter than the chunks)."""
    per = draw(st.integers(1, 2))
    silent = draw(st.integers(-1, world - 1))
    sent = [[[0 if i == silent else draw(st.integers(0, 3)) for _ in range(per)] for _ in range(world)]
            for i in range(world)]
    n = max(sum(map(sum, row)) for row in sent) + draw(st.integers(0, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    ins = [{"x": torch.randn(n, D, generator=g), "s": torch.tensor([sum(c) for c in sent[j]]),
            "r": torch.tensor([sum(sent[i][j]) for i in range(world)]),
            "c": torch.tensor([sent[i][j] for i in range(world)]),
            **{w: torch.randn(per, *shape, generator=g) for w, shape in (("w1", (D, F)), ("w3", (D, F)),
                                                                             ("w2", (F, D)))}}
           for j in range(world)]
    return world * per, n, ins


def _backward_inputs(p: cw.Program, bwd: cw.Program, ins: list[dict], seed: int) -> list[dict]:
    """The backward's inputs from the forward's (what it saved, as written) and random output gradients."""
    g = torch.Generator().manual_seed(seed)
    saved = [r.outputs for r in reference.run(p, ins)]
    return [{"g": torch.randn(i["x"].shape, generator=g), "s": i["s"], "r": i["r"], "c": i["c"],
             **{k: t for k, t in o.items() if k in bwd.inputs},
             **{f"{k}t": i[k].transpose(1, 2).contiguous() for k in ("w1", "w3", "w2")}} for i, o in zip(ins, saved)]


def _programs(world: int, e: int, n: int, ins: list[dict]) -> list[tuple[cw.Program, list[dict]]]:
    fwd = workloads.moe_dropless(R=world, E=e, N=n, D=D, F=F, save=True)
    bwd = workloads.moe_dropless_backward(R=world, E=e, N=n, D=D, F=F)
    return [(fwd, ins), (bwd, _backward_inputs(fwd, bwd, ins, n))]


def _same(got: list[dict], want: list[dict]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), world=st.integers(1, 4), chunks=st.sampled_from([2, 4]))
def test_chunked_forward_and_backward_equal_the_program_as_written_on_the_reference(data, world, chunks):
    e, n, ins = data.draw(routings(world))
    for p, inputs in _programs(world, e, n, ins):
        want = [r.outputs for r in reference.run(p, inputs)]
        _same([r.outputs for r in reference.run(_chunked(p, chunks), inputs)], want)


@pytest.mark.parametrize("world", [2, 4])
def test_chunked_forward_and_backward_equal_the_program_as_written_on_the_torch_backend(local_world, world):
    ranks = local_world(world)

    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        e, n, ins = data.draw(routings(world))
        for p, inputs in _programs(world, e, n, ins):
            want = [r.outputs for r in reference.run(p, inputs)]
            schedules = [_chunked(p, k, shm) for k in (2, 4) for shm in (False, True)]
            got = ranks.run(run_schedules, schedules, inputs, {})
            for i in range(len(schedules)):
                _same([got[j][i].outputs for j in range(world)], want)

    check()


def test_a_silent_rank_and_one_row_in_four_chunks_leave_empty_chunks_that_still_exchange():
    """Rank 1 sends nothing; rank 0 sends rank 1 one row: chunks 0-2 are empty everywhere, chunk 3 holds it."""
    x = torch.arange(8.0).reshape(2, 4)
    ins = [{"x": x, "s": torch.tensor([0, 1]), "r": torch.tensor([0, 0]), "c": torch.tensor([[0], [0]])},
           {"x": x + 10, "s": torch.tensor([0, 0]), "r": torch.tensor([1, 0]), "c": torch.tensor([[1], [0]])}]
    for i in ins:
        i |= {w: torch.ones(1, *shape) for w, shape in (("w1", (D, F)), ("w3", (D, F)), ("w2", (F, D)))}
    p = workloads.moe_dropless(R=2, E=2, N=2, D=D, F=F, save=True)
    want = [r.outputs for r in reference.run(p, ins)]
    assert want[0]["y"][0].abs().sum() > 0 and want[0]["y"][1].abs().sum() == 0 and want[1]["got"][1:].eq(0).all()
    chunked = _chunked(p, 4)
    _same([r.outputs for r in reference.run(chunked, ins)], want)
    again = Schedule.from_json(chunked.to_json(), p)  # saved and rebuilt: the same stages
    assert again.name == chunked.name == "ol(A2AV,MM,MM,c,MM,A2AV,4)" and again.stages == chunked.stages


def test_segment_counts_that_disagree_with_the_rows_received_are_refused_at_run_time():
    n = 3
    x = torch.ones(n, D)
    w = {k: torch.ones(1, *shape) for k, shape in (("w1", (D, F)), ("w3", (D, F)), ("w2", (F, D)))}
    ins = [{"x": x, "s": torch.tensor([1, 1]), "r": torch.tensor([1, 1]), "c": torch.tensor([[1], [0]]), **w},
           {"x": x, "s": torch.tensor([1, 1]), "r": torch.tensor([1, 1]), "c": torch.tensor([[1], [1]]), **w}]
    p = workloads.moe_dropless(R=2, E=2, N=n, D=D, F=F)
    with pytest.raises(InputError, match="segment counts `c`"):
        reference.run(_chunked(p, 2), ins)


def test_a_negative_row_count_is_refused_naming_the_counts():
    """Checked where the chunks read the counts, before any chunk's arithmetic turns them into other numbers."""
    n = 3
    x = torch.ones(n, D)
    w = {k: torch.ones(1, *shape) for k, shape in (("w1", (D, F)), ("w3", (D, F)), ("w2", (F, D)))}
    ins = [{"x": x, "s": torch.tensor([2, -1]), "r": torch.tensor([2, 1]), "c": torch.tensor([[2], [1]]), **w},
           {"x": x, "s": torch.tensor([1, 1]), "r": torch.tensor([-1, 1]), "c": torch.tensor([[0], [1]]), **w}]
    p = workloads.moe_dropless(R=2, E=2, N=n, D=D, F=F)
    with pytest.raises(InputError, match="`[sr]` must hold 2 non-negative row counts"):
        reference.run(_chunked(p, 2), ins)


# -- refusals -------------------------------------------------------------------------------------------------


def _dispatch(name: str) -> tuple[cw.Program, cw.Value, cw.Value, cw.Value, cw.Value, Layout]:
    p = cw.Program(name)
    p.mesh(ep=2)
    mine, ep = Layout(ep=Local), Layout(ep=Sliced(0))
    x = p.tensor("x", (8, D), "float32", mine)
    s, r, c = (p.tensor(k, shape, "int64", mine) for k, shape in (("s", (2,)), ("r", (2,)), ("c", (2, 1))))
    return p, cw.all_to_all(x, 0, splits=s, recv=r, rows=16), s, r, c, ep


@pytest.mark.parametrize("outside", ["z", "z_pad"])  # z_pad: the generated code's own name for z's padding rows
def test_an_elementwise_value_read_after_the_chain_gets_its_padding_rows_as_written(local_world, outside):
    """An elementwise value kept as a result holds rows no chunk computes (past the counts'): computed once after the
    chunks from its operands' padding rows (zero for the exchange's and the GEMM's, an outside tensor's own rows), as
    the program as written computes them (here nonzero: + 1 and a random outside tensor)."""
    p, got, s, r, c, ep = _dispatch("padding_out")
    h = cw.grouped_matmul(got, p.tensor("w", (2, D, D), "float32", ep), c)
    act = (h * 2.0 + 1.0) * p.tensor(outside, (16, D), "float32", Layout(ep=Local))
    p.output(cw.all_to_all(act + got, 0, splits=r, recv=s, rows=8), "y")
    p.output(act, "act")
    found = [x for x in enumerate_schedules(p) if x.name.startswith("ol(")]
    assert len(found) == 4
    rows = check_schedules(p, found, 2, seed=3) + check_schedules(p, found, 2, seed=4,
                                                                  batch=torch_runner(local_world(2)))
    assert all(r.ok for r in rows), rows
    ins = make_inputs(p, 2, {}, seed=3)
    want = reference.run(p, ins)
    assert any(w.outputs["act"][int(i["r"].sum()):].abs().sum() > 0 for w, i in zip(want, ins))  # padding matters


def test_a_weight_gradient_read_inside_the_chain_is_refused():
    p, got, s, r, c, ep = _dispatch("wgrad_inside")
    gw = cw.grouped_matmul_wgrad(got, got, c)
    p.output(cw.all_to_all(cw.grouped_matmul(got, gw, c), 0, splits=r, recv=s, rows=8), "y")
    with pytest.raises(ScheduleError, match="reads grouped_matmul_wgrad .* whole only once every chunk has added"):
        _chunked(p, 2)


def test_dropout_inside_the_chain_is_refused():
    p, got, s, r, c, ep = _dispatch("dropout_inside")
    h = cw.dropout(cw.grouped_matmul(got, p.tensor("w", (2, D, D), "float32", ep), c), 0.1, seed=3)
    p.output(cw.all_to_all(h, 0, splits=r, recv=s, rows=8), "y")
    with pytest.raises(ScheduleError, match="draws random numbers by element position"):
        _chunked(p, 2)


# -- the cost model ----------------------------------------------------------------------------------------------


def test_the_cost_model_prices_library_exchanges_as_a_pipeline_shared_memory_ones_in_series_and_the_copies():
    p = workloads.moe_dropless(R=2, E=4, N=64, D=16, F=32)
    cal = Calibration("torch", "cpu", 2, {"all_to_all_v/library": AlphaBeta(0.0, 50.0),
                                          "all_to_all_v/shm": AlphaBeta(0.0, 50.0)},
                      {"float32": AlphaBeta(0.0, 1.0)}, {"float32": AlphaBeta(0.0, 1.0)}, chunk_overhead_ms=1e-3)
    written = predict_plan(lower(Schedule(p)), {}, 2, cal).stage_ms
    serial = sum(written.values())
    longest = max(written.values())
    for k in (2, 4):
        for shm in (False, True):
            s = _chunked(p, k, shm)
            ms = predict_plan(lower(s), {}, 2, cal).stage_ms[f"0:{s.stages[0].label}"]
            # each part a K-th of its written stage; shared memory's exchanges are waited for one by one; x's rows
            # gathered and y's put back cost a read and a write each (64 x 16 float32, kernel line 1 ms/MB)
            copies = 2 * (64 * 16 * 4 + 64 * 16 * 4) / 1e6
            want = serial + k * 1e-3 if shm else serial / k + (k - 1) * longest / k + k * 1e-3
            want += copies
            assert ms == pytest.approx(want, rel=1e-6), (k, shm)


def test_16_bit_partial_sums_are_added_in_float32_and_rounded_once():
    """bfloat16 256 + 0.5 rounds back to 256 (its spacing there is 2): added in bfloat16, 256 + 0.5 - 256 is 0."""
    pieces = [torch.tensor([256.0], dtype=torch.bfloat16), torch.tensor([0.5], dtype=torch.bfloat16),
              torch.tensor([-256.0], dtype=torch.bfloat16)]
    out = row_sets.accumulate(pieces)
    assert out.dtype == torch.bfloat16 and float(out) == 0.5
