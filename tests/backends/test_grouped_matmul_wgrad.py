"""grouped_matmul_wgrad (`cw.grouped_matmul_wgrad(x, dy, counts)`, grouped_matmul's weight gradient: per group, the
sum over its segments of x_segᵀ dy_seg): the reference and the torch backend equal torch autograd of grouped_matmul
written row by row here (each row times its segment's matrix), over counts with zeros, whole idle groups and rows of
padding past the segments, one line of counts or one per source rank; random inputs draw counts that fit; the
layouts it refuses are one sentence; the cost model prices 2 M K N; no schedule chunks it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.errors import InputError, ProgramError
from cocoweave.schedule.schedule import Schedule


def _program(m: int, k: int, n: int, lines: int, per: int) -> cw.Program:
    """gw = grouped_matmul_wgrad(x [m, k], dy [m, n], counts [lines, per] (or [per])), all Local."""
    p = cw.Program("gmm_wgrad")
    x = p.tensor("x", (m, k), "float32", cw.Local)
    dy = p.tensor("dy", (m, n), "float32", cw.Local)
    c = p.tensor("c", (lines, per) if lines else (per,), "int64", cw.Local)
    p.output(cw.grouped_matmul_wgrad(x, dy, c), "gw")
    return p


def _autograd(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch autograd's gradient of w [G, K, N] in sum(y * dy), y's row i = x_i w[its segment mod G], row by row."""
    g = counts.shape[-1] if counts.ndim else 1
    c = counts.reshape(-1)
    group = torch.arange(len(c)).repeat_interleave(c) % g
    w = torch.zeros(g, x.shape[1], dy.shape[1], dtype=torch.float64, requires_grad=True)
    n = len(group)
    y = torch.einsum("mk,mkn->mn", x[:n].double(), w[group])
    (y * dy[:n].double()).sum().backward()
    return w.grad.float()


@st.composite
def cases(draw, world: int):
    k, n, per = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    lines = draw(st.sampled_from([0, 1, 3]))
    counts = [[draw(st.integers(0, 4)) * draw(st.sampled_from([0, 1])) for _ in range(per * max(lines, 1))]
              for _ in range(world)]
    m = max(sum(c) for c in counts) + draw(st.integers(0, 3))
    return k, n, per, lines, counts, m, draw(st.integers(0, 99))


def _inputs(world: int, case: tuple) -> tuple[cw.Program, list[dict]]:
    k, n, per, lines, counts, m, seed = case
    gen = torch.Generator().manual_seed(seed)
    shape = (lines, per) if lines else (per,)
    ins = [{"x": torch.randn(m, k, generator=gen), "dy": torch.randn(m, n, generator=gen),
            "c": torch.tensor(counts[r]).reshape(shape)} for r in range(world)]
    return _program(m, k, n, lines, per), ins


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), world=st.integers(1, 3))
def test_the_reference_equals_torch_autograd_of_grouped_matmul(data, world):
    case = data.draw(cases(world))
    p, ins = _inputs(world, case)
    res = reference.run(p, ins)
    for r in range(world):
        want = _autograd(ins[r]["x"], ins[r]["dy"], ins[r]["c"])
        torch.testing.assert_close(res[r].outputs["gw"], want, rtol=1e-5, atol=1e-5)


def test_the_torch_backend_equals_the_reference(local_world):
    w = local_world(2)

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        case = data.draw(cases(2))
        p, ins = _inputs(2, case)
        want = reference.run(p, ins)
        got = w.run(run_schedules, [Schedule(p)], ins, {})
        for r in range(2):
            torch.testing.assert_close(got[r][0].outputs["gw"], want[r].outputs["gw"], rtol=1e-6, atol=1e-6)

    check()


def test_random_inputs_draw_counts_that_fit_so_the_equivalence_checks_run():
    from cocoweave.equivalence.check import check_schedules
    from cocoweave.schedule.enumerate import enumerate_schedules

    p = _program(6, 3, 4, 2, 2)
    found = enumerate_schedules(p)
    for seed in range(4):
        rows = check_schedules(p, found, 2, seed=seed)
        assert len(rows) == len(found) and all(row.ok for row in rows), rows


def test_layouts_and_counts_it_refuses():
    def build(x_layout=cw.Local, dy_layout=cw.Local, c_layout=cw.Local, dy_rows=8, dy_ndim=2, c_dtype="int64"):
        p = cw.Program("bad")
        x = p.tensor("x", (8, 4), "float32", x_layout)
        dy = p.tensor("dy", (dy_rows, 5) if dy_ndim == 2 else (dy_rows,), "float32", dy_layout)
        c = p.tensor("c", (4,), c_dtype, c_layout)
        return cw.grouped_matmul_wgrad(x, dy, c)

    sentences = {
        "`x` is Sliced(0): each rank sums over its own whole segments": dict(x_layout=cw.Sliced(0)),
        "`dy` is Sliced(1): each rank sums over its own whole segments": dict(dy_layout=cw.Sliced(1)),
        "`c` is Sliced(0)": dict(c_layout=cw.Sliced(0)),
        "different numbers of rows (8 vs 6)": dict(dy_rows=6),
        "needs rows x of shape [M, K]": dict(dy_ndim=1),
        "int32 or int64 tensor": dict(c_dtype="float32"),
    }
    for sentence, kw in sentences.items():
        with pytest.raises(ProgramError, match="grouped_matmul_wgrad") as e:
            build(**kw)
        assert sentence in str(e.value), (kw, str(e.value))
    assert build().layout.is_local and tuple(build().shape) == (4, 4, 5)
    with pytest.raises(InputError, match="sum to at most the 8 rows"):
        reference.run(_program(8, 2, 2, 0, 2), [{"x": torch.randn(8, 2), "dy": torch.randn(8, 2),
                                                 "c": torch.tensor([5, 4])}])


def test_the_cost_model_prices_its_rows_and_no_schedule_chunks_it():
    from cocoweave.errors import ScheduleError
    from cocoweave.perf.costmodel import AlphaBeta, Calibration, predict_plan
    from cocoweave.plan import lower

    p = _program(12, 8, 5, 0, 3)
    cal = Calibration("gloo", "cpu", 2, {}, {}, {"float32": AlphaBeta(0.25, 1.0)})
    assert predict_plan(lower(Schedule(p)), {}, 2, cal).features["gflop"] == pytest.approx(2 * 12 * 8 * 5 / 1e9)
    q = cw.Program("chain")
    x = q.tensor("x", (12, 8), "float32", cw.Local)
    gw = cw.grouped_matmul_wgrad(x * 2.0, x, q.tensor("c", (3,), "int64", cw.Local))
    q.output(cw.all_reduce(gw), "y")
    s = Schedule(q)
    with pytest.raises(ScheduleError, match="cannot overlap"):
        s.overlap(s.find("mul")[0], s.find("grouped_matmul_wgrad")[0], s.find("all_reduce")[0], chunks=2)
