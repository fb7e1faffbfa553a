"""Every transformation's preconditions, accepted and refused, with the sentence the user sees."""

import pytest

import cocoweave as cw
from cocoweave.errors import ScheduleError
from cocoweave.ir.loader import load_example
from cocoweave.schedule.schedule import Schedule


def example(name, func, **sizes):
    return load_example(f"{name}.py:{func}", **sizes)


def split_reorder(s):
    _, ag = s.split(s.find("all_reduce")[0])
    return s.reorder(ag)


def test_split_turns_all_reduce_into_reduce_scatter_and_all_gather():
    s = Schedule(example("adam", "adam", N=10))
    rs, ag = s.split(s.find("all_reduce")[0], dim=0)
    assert (rs.label, ag.label) == ("RS", "AG")
    ops = [v.op for v in s.program.values]
    assert "all_reduce" not in ops and "reduce_scatter" in ops and "all_gather" in ops
    assert s.name == "RS-AG-c"


def test_split_refuses_adasum_and_scalars_and_bad_dims():
    p = cw.Program("t")
    g = p.tensor("g", (4,), "float32", cw.Local)
    p.output(cw.all_reduce(g, "adasum"), "a")
    p.output(cw.all_reduce(cw.sum(g)), "b")
    p.output(cw.all_reduce(g * 2), "c")
    s = Schedule(p)
    a, b, c = (st.anchor for st in s.find("all_reduce"))
    with pytest.raises(ScheduleError, match=r"cannot split `%\d+`: adasum combines whole tensors"):
        s.split(a)
    with pytest.raises(ScheduleError, match="a 0-dim tensor has nothing to scatter"):
        s.split(b)
    with pytest.raises(ScheduleError, match="along dimension 3: it has 1 dimensions"):
        s.split(c, dim=3)
    with pytest.raises(ScheduleError, match="it is a mul, not an all_reduce"):
        s.split(s.program.values[-2].name if s.program.values[-2].op == "mul" else "%5")


def test_reorder_moves_computation_onto_slices_and_gathers_live_outs():
    s = Schedule(example("adam", "adam", N=10))
    split_reorder(s)
    assert s.name == "RS-c-AG"
    sliced = [v for v in s.program.values if v.op in ("add", "mul", "sub", "div", "sqrt")]
    assert all(v.layout.is_sliced or v.is_scalar for v in sliced)
    gathers = sorted(v.name for v in s.program.values if v.op == "all_gather")
    assert gathers == ["m.ag", "v.ag", "w.ag"]


def test_reorder_inserts_all_reduce_for_norms_over_slices():
    s = Schedule(example("lamb", "lamb", N=10))
    split_reorder(s)
    small = [v for v in s.program.values if v.op == "all_reduce"]
    assert len(small) == 2 and all(v.shape == () for v in small)


def test_reorder_gathers_an_output_a_pulled_in_feeder_slices():
    """`c = sqrt(abs(s))` reads Replicated state and only region values read it, so it joins the region on slices
    after `t = sum(y) + c`'s dimension was decided (none: the sum is a scalar): `t` is sliced all the same, and the
    output must be gathered back to its whole, Replicated self (each rank got half of it before)."""
    from cocoweave.equivalence.check import check_schedules

    p = cw.Program("feeder")
    g = p.tensor("g", (2,), "float32", cw.Local)
    s = p.tensor("s", (2,), "float32", cw.Replicated, init="positive")
    y = cw.all_reduce(g, "sum")
    c = cw.sqrt(cw.abs(s))
    p.update(s, cw.abs(y + c))
    p.output(cw.sum(y) + c, "out")
    sch = Schedule(p)
    sch.split(y.name, dim=0)
    sch.reorder(f"{y.name}.ag")
    assert sch.program.outputs[0][1].layout.is_replicated
    assert all(r.ok for r in check_schedules(p, [sch], 2, seed=0)), sch.name


def test_reorder_refuses_a_local_operand():
    p = cw.Program("t")
    g = p.tensor("g", (8,), "float32", cw.Local)
    h = p.tensor("h", (8,), "float32", cw.Local)
    p.output(cw.all_reduce(cw.all_reduce(g) + h), "y")
    s = Schedule(p)
    _, ag = s.split(s.find("all_reduce")[0])
    with pytest.raises(ScheduleError, match=r"cannot reorder `%\d+ = add\(%\d+\.ag, h\)` before the all_gather "
                                            r"`%\d+\.ag`: it reads `h`, which is Local"):
        s.reorder(ag)


def test_reorder_refuses_when_nothing_can_move():
    p = cw.Program("t")
    g = p.tensor("g", (4, 8), "float32", cw.Local)
    w = p.tensor("w", (8, 8), "float32")
    p.output(cw.matmul(cw.all_reduce(g), w))
    s = Schedule(p)
    _, ag = s.split(s.find("all_reduce")[0])
    with pytest.raises(ScheduleError, match=r"nothing after it can work on slices \(it is read by `%\d+ = matmul"):
        s.reorder(ag)


def test_as_slice_stores_state_sliced_and_removes_its_gather():
    s = Schedule(example("adam", "adam", N=10))
    split_reorder(s)
    s.as_slice("m", "v")
    assert s.program.inputs["m"].layout == cw.Sliced(0) and s.program.inputs["w"].layout == cw.Replicated
    assert sorted(v.name for v in s.program.values if v.op == "all_gather") == ["w.ag"]
    assert s.name == "RS-c-AG+slice(m,v)" and s.sliced_state == ["m", "v"]


def test_as_slice_refuses_state_read_whole():
    s = Schedule(example("adam", "adam", N=10))
    with pytest.raises(ScheduleError, match=r"cannot store `m` sliced: `%\d+ = mul\(beta1, m\)` reads it whole"):
        s.as_slice("m")
    with pytest.raises(ScheduleError, match="has no tensor input `q`"):
        s.as_slice("q")
    with pytest.raises(ScheduleError, match="it is Local, only Replicated tensors can be"):
        s.as_slice("g")


def test_as_slice_refuses_a_tensor_that_is_an_output():
    p = cw.Program("t")
    g = p.tensor("g", (6,), "float32", cw.Local)
    s = p.tensor("s", (6,), "float32")
    p.update(s, cw.all_reduce(g) * 2)
    p.output(s, "old_s")
    sch = Schedule(p)
    sch.reorder(sch.split(sch.find("all_reduce")[0])[1])
    with pytest.raises(ScheduleError, match="cannot store `s` sliced: it is the program's output `old_s`"):
        sch.as_slice("s")


def test_fuse_computations_and_rs_c_ag():
    s = Schedule(example("adam", "adam", N=10))
    split_reorder(s)
    s.as_slice("m", "v")
    rs, c, ag = s.stages
    s.fuse(c)
    assert s.name == "RS-C-AG+slice(m,v)"
    s.fuse(rs, c, ag)
    assert s.name == "fuse(RS-C-AG)+slice(m,v)" and len(s.stages) == 1


def test_fuse_refusals():
    s = Schedule(example("model_parallel", "layer", B=2, S=4, H=8))
    mm, ar, c = s.stages
    with pytest.raises(ScheduleError, match="cannot fuse MM-AR: only computations, or a reduce_scatter"):
        s.fuse(mm, ar)
    with pytest.raises(ScheduleError, match="are not consecutive"):
        s.fuse(mm, c)
    with pytest.raises(ScheduleError, match="no stage computes `nope`"):
        s.fuse("nope")


def test_overlap_chunks_a_matmul_collective_epilogue_chain():
    s = Schedule(example("model_parallel", "layer", B=2, S=4, H=8))
    split_reorder(s)
    mm = s.stages[0]
    f = s.fuse(*s.stages[1:])
    st = s.overlap(mm, f, chunks=4)
    assert s.name == "ol(MM,fuse(RS-C-AG),4)" and st.chunk_dim == 1  # not B (scattered), not H (contracted)


def test_overlap_refusals():
    s = Schedule(example("adam", "adam", N=10))
    split_reorder(s)
    rs, c, *ags = s.stages
    with pytest.raises(ScheduleError, match="no dimension can be chunked"):
        s.overlap(rs, c, chunks=2)
    with pytest.raises(ScheduleError, match="needs 2 to 64 chunks"):
        s.overlap(rs, c, chunks=1)
    with pytest.raises(ScheduleError, match="needs a chain of at least two stages"):
        s.overlap(rs, chunks=2)
    lamb = Schedule(example("lamb", "lamb", N=10))
    ar, comp = lamb.stages
    with pytest.raises(ScheduleError, match=r"reduces across the chunks"):
        lamb.overlap(ar, comp, chunks=2)
    with pytest.raises(ScheduleError, match="`b` does not read what `a` or a stage before it makes"):
        Schedule(two_independent_collectives()).overlap("a", "b", chunks=2)


def two_independent_collectives():
    p = cw.Program("two")
    x = p.tensor("x", (4, 4), "float32", cw.Local)
    y = p.tensor("y", (4, 4), "float32", cw.Local)
    a = cw.all_reduce(x)
    b = cw.all_reduce(y)
    a.name, b.name = "a", "b"
    p.output(a, "a")
    p.output(b, "b")
    return p


def test_rewrites_must_come_before_grouping():
    s = Schedule(example("adam", "adam", N=10))
    s.fuse(s.stages[1])
    with pytest.raises(ScheduleError, match="split must come before fuse and overlap"):
        s.split(s.find("all_reduce")[0])


def test_schedule_json_round_trip_replay_and_fingerprint():
    p = example("model_parallel", "layer", B=2, S=4, H=8)
    s = Schedule(p)
    split_reorder(s)
    s.overlap(s.stages[0], s.fuse(*s.stages[1:]), chunks=2)
    again = Schedule.from_json(s.to_json(), example("model_parallel", "layer", B=2, S=4, H=8))
    assert again.name == s.name and again.fingerprint() == s.fingerprint()
    assert str(again.program) == str(s.program)
    assert Schedule(p).fingerprint() != s.fingerprint()
    with pytest.raises(ScheduleError, match="was made for program `model_parallel` with fingerprint"):
        Schedule.from_json(s.to_json(), example("model_parallel", "layer", B=2, S=4, H=16))
    text = str(s)
    assert "step split(" in text and "step overlap(" in text and "stage 0: ol(MM,fuse(RS-C-AG),2)" in text
