"""grouped_matmul (`cw.grouped_matmul(x, w, counts)`, a dropless MoE's expert GEMMs over runtime per-expert counts):
the reference and the torch backend equal a row-by-row computation written here (each row times its segment's
matrix, found by repeat_interleave of the counts), over counts with zeros and rows past the segments (padding, zero
rows out), one line of counts or one per source rank, float32 and bfloat16, experts Replicated or Sliced over the
ranks; random inputs draw counts that fit; the layouts it refuses and counts that do not fit are one sentence; the
cost model prices it at its capacity; no schedule chunks it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.errors import InputError, ProgramError
from cocoweave.schedule.schedule import Schedule


def _program(m: int, k: int, n: int, g: int, lines: int, sliced: bool, dtype: str = "float32") -> cw.Program:
    """y = grouped_matmul(x [m, k] Local, w [g, k, n] (Sliced by expert or Replicated), counts [lines, g / ranks])."""
    p = cw.Program("gmm")
    x = p.tensor("x", (m, k), dtype, cw.Local)
    w = p.tensor("w", (g, k, n), dtype, cw.Sliced(0) if sliced else cw.Replicated)
    shape = (lines, "G") if lines else ("G",)
    c = p.tensor("c", shape, "int64", cw.Local)
    p.output(cw.grouped_matmul(x, w, c), "y")
    return p


def _rows(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row by row: row i of segment s (counts read in row-major order) times w[s mod G]; zero past the segments."""
    c = counts.reshape(-1)
    group = torch.arange(len(c)).repeat_interleave(c) % w.shape[0]
    out = torch.zeros(x.shape[0], w.shape[2])
    n = len(group)
    out[:n] = torch.einsum("mk,mkn->mn", x[:n].double(), w[group].double()).float()
    return out


@st.composite
def cases(draw, world: int):
    """Sizes, one or several lines of counts, each rank's counts with zeros (whole ranks of them at times) and
    rows left over past them."""
    k, n, per = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    lines = draw(st.sampled_from([0, 1, 3]))
    sliced = draw(st.booleans())
    g = per * world if sliced else per
    counts = [[draw(st.integers(0, 4)) * draw(st.sampled_from([0, 1])) for _ in range(per * max(lines, 1))]
              for _ in range(world)]
    m = max(sum(c) for c in counts) + draw(st.integers(0, 3))
    return k, n, g, per, lines, sliced, counts, m, draw(st.integers(0, 99))


def _inputs(world: int, case: tuple, dtype: str = "float32") -> tuple[cw.Program, list[dict], torch.Tensor]:
    k, n, g, per, lines, sliced, counts, m, seed = case
    p = _program(m, k, n, g, lines, sliced, dtype)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(g, k, n, generator=gen).to(getattr(torch, dtype))
    shape = (lines, per) if lines else (per,)
    ins = [{"x": torch.randn(m, k, generator=gen).to(getattr(torch, dtype)),
            "w": w[r * per:(r + 1) * per].clone() if sliced else w.clone(),
            "c": torch.tensor(counts[r]).reshape(shape)} for r in range(world)]
    return p, ins, w


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), world=st.integers(1, 3))
def test_the_reference_multiplies_each_segment_by_its_groups_matrix(data, world):
    case = data.draw(cases(world))
    p, ins, _ = _inputs(world, case)
    res = reference.run(p, ins, {"G": case[3]})
    for r in range(world):
        want = _rows(ins[r]["x"], ins[r]["w"], ins[r]["c"])
        torch.testing.assert_close(res[r].outputs["y"], want, rtol=1e-6, atol=1e-6)
        assert not res[r].outputs["y"][int(ins[r]["c"].sum()):].any()  # padding rows give zero rows


@pytest.mark.parametrize("world", [2])
def test_the_torch_backend_equals_the_reference(local_world, world):
    w = local_world(world)

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        case = data.draw(cases(world))
        dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
        p, ins, _ = _inputs(world, case, dtype)
        want = reference.run(p, ins, {"G": case[3]})
        got = w.run(run_schedules, [Schedule(p)], ins, {"G": case[3]})
        for r in range(world):
            assert torch.equal(got[r][0].outputs["y"], want[r].outputs["y"]), (case, r)

    check()


def test_random_inputs_draw_counts_that_fit_so_the_equivalence_checks_run(local_world):
    """make_inputs draws counts that are non-negative and sum to at most the rows (zeros included, rows left over)
    where random integers would not fit; check_schedules then runs every schedule on the reference and Gloo ranks."""
    from cocoweave.equivalence.check import check_schedules, torch_runner
    from cocoweave.schedule.enumerate import enumerate_schedules

    p = _program(6, 3, 4, 4, 2, sliced=True)
    zeros = short = 0
    for seed in range(8):
        ins = make_inputs(p, 2, {"G": 2}, seed=seed)
        for r in range(2):
            c = ins[r]["c"]
            assert c.shape == (2, 2) and c.min() >= 0 and c.sum() <= 6
            zeros += int((c == 0).sum())
            short += int(c.sum() < 6)
        reference.run(p, ins, {"G": 2})
    assert zeros and short
    found = enumerate_schedules(p)
    rows = check_schedules(p, found, 2, {"G": 2}, seed=3, batch=torch_runner(local_world(2)))
    assert len(rows) == len(found) and all(row.ok for row in rows), rows


def test_layouts_and_counts_it_refuses():
    def build(x_layout=cw.Local, w_layout=cw.Replicated, c_layout=cw.Local, c_shape=(3,), c_dtype="int64",
              mesh=False):
        p = cw.Program("bad")
        if mesh:  # along the mesh's one axis ep
            p.mesh(ep=2)
            x_layout, w_layout, c_layout = (cw.Layout(ep=q) for q in (x_layout, w_layout, c_layout))
        x = p.tensor("x", (8, 4), "float32", x_layout)
        w = p.tensor("w", (6 if mesh else 3, 4, 5), "float32", w_layout)
        c = p.tensor("c", c_shape, c_dtype, c_layout)
        return cw.grouped_matmul(x, w, c)

    sentences = {
        "rows are sliced, which would cut segments": dict(x_layout=cw.Sliced(0)),
        "inner dimension is sliced; all_gather it first": dict(x_layout=cw.Sliced(1)),
        "each rank needs all of its segments' counts": dict(c_layout=cw.Sliced(0), c_shape=(4,)),
        "only its experts (dimension 0) may be sliced": dict(w_layout=cw.Sliced(2)),
        "int32 or int64 tensor": dict(c_dtype="float32"),
        "must be the number of groups each rank holds (3 over 1 ranks)": dict(c_shape=(4,)),
        "must be the number of groups each rank holds (6 over 2 ranks)": dict(w_layout=cw.Sliced(0), c_shape=(6,),
                                                                            mesh=True),
        "the counts need equal parts": dict(w_layout=cw.Sliced(0, (1, 2)), mesh=True),
    }
    for sentence, kw in sentences.items():
        with pytest.raises(ProgramError, match="grouped_matmul") as e:
            build(**kw)
        assert sentence in str(e.value), (kw, str(e.value))
    assert build(w_layout=cw.Sliced(0), c_shape=(3,), mesh=True).layout.is_local
    p = cw.Program("rep")
    y = cw.grouped_matmul(p.tensor("x", (4, 2)), p.tensor("w", (2, 2, 3)), p.tensor("c", (2,), "int32"))
    assert y.layout == cw.Replicated  # every operand Replicated: every rank computes the same rows


def test_counts_that_do_not_fit_are_one_sentence():
    p = _program(4, 2, 2, 2, 0, sliced=False)
    base = {"x": torch.randn(4, 2), "w": torch.randn(2, 2, 2)}
    for counts, words in (([3, 2], "sum to at most the 4 rows"), ([-1, 2], "must be non-negative")):
        with pytest.raises(InputError, match=words):
            reference.run(p, [{**base, "c": torch.tensor(counts)}], {"G": 2})


def test_the_cost_model_prices_it_at_its_capacity_and_no_schedule_chunks_it():
    """The counts are unknown statically: the tuner prices 2 x M x K x N (every row in a segment, the most it
    computes); Overlap refuses a chain whose grouped_matmul's counts are not one line per rank (row-set chunks split
    each rank's line of an all_to_all_v's rows: schedule/rows.py)."""
    from cocoweave.errors import ScheduleError
    from cocoweave.perf.costmodel import AlphaBeta, Calibration, predict_plan
    from cocoweave.plan import lower
    from cocoweave.schedule.enumerate import enumerate_schedules

    p = _program(12, 8, 5, 3, 0, sliced=False)
    cal = Calibration("gloo", "cpu", 2, {}, {}, {"float32": AlphaBeta(0.25, 1.0)})
    pred = predict_plan(lower(Schedule(p)), {"G": 3}, 2, cal)
    assert pred.features["gflop"] == pytest.approx(2 * 12 * 8 * 5 / 1e9)
    q = cw.Program("chain")
    x = q.tensor("x", (12, 8), "float32", cw.Local)
    h = cw.grouped_matmul(x, q.tensor("w", (3, 8, 8)), q.tensor("c", (3,), "int64", cw.Local))
    q.output(cw.all_reduce(h * 2.0), "y")
    s = Schedule(q)
    with pytest.raises(ScheduleError, match="counts `c` are not one line of segments per rank"):
        s.overlap(s.find("grouped_matmul")[0], s.find("mul")[0], s.find("all_reduce")[0], chunks=2)
    assert not any("ol(" in s.name for s in enumerate_schedules(q))
