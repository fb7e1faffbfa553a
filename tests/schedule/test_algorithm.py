"""Choosing a collective algorithm is a checked, replayable, fingerprinted schedule step that does not
change results (the reference backend runs every algorithm the same way)."""

import pytest

import cocoweave as cw
from cocoweave.equivalence.check import check_schedules
from cocoweave.errors import ScheduleError
from cocoweave.ir.loader import load_example
from cocoweave.plan import Collective, FusedCollective, lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule


def _adam_fused() -> Schedule:
    return next(s for s in enumerate_schedules(load_example("adam.py:adam", N=10)) if s.name == "fuse(RS-C-AG)")


def test_ring_is_recorded_named_lowered_and_replayed():
    s = _adam_fused()
    before = s.fingerprint()
    stage = s.algorithm(s.stages[0], "ring")
    assert stage.algorithm == "ring" and s.name == "fuse(RS-C-AG)@ring" and s.fingerprint() != before
    assert s.steps[-1].to_json() == {"step": "algorithm", "ref": stage.anchor, "algorithm": "ring"}
    plan = lower(s)
    assert isinstance(plan.stages[0], FusedCollective) and plan.stages[0].algorithm == "ring"
    assert plan.stages[0].label == "fuse(RS-C-AG)@ring"
    again = Schedule.from_json(s.to_json(), s.original)
    assert again.name == s.name and again.fingerprint() == s.fingerprint()
    assert "algorithm(" in str(s)


def test_enumeration_adds_ring_variants_and_keeps_the_other_names():
    names = [s.name for s in enumerate_schedules(load_example("adam.py:adam", N=10))]
    assert names[:2] == ["AR-c", "AR-C"]
    assert {"AR@ring-C", "fuse(RS-C-AG)@ring", "fuse(RS-C-AG)@ring+slice(m,v)", "fuse(RS-C-AG)"} <= set(names)
    mp = enumerate_schedules(load_example("model_parallel.py:layer", B=2, S=4, H=8))
    ring = next(s for s in mp if s.name == "MM-AR@ring-C")
    assert [st.algorithm for st in lower(ring).stages if isinstance(st, Collective)] == ["ring"]


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_ring_schedules_equal_the_program_on_the_reference(world_size):
    program = load_example("adam.py:adam", N=11)
    ring = [s for s in enumerate_schedules(program) if "@ring" in s.name]
    rows = check_schedules(program, ring, world_size, {})
    assert len(rows) == 3 and all(r.ok for r in rows), rows


def test_refusals_say_what_is_wrong():
    s = _adam_fused()
    with pytest.raises(ScheduleError, match="unknown collective algorithm 'tree'"):
        s.algorithm(s.stages[0], "tree")
    lamb = next(x for x in enumerate_schedules(load_example("lamb.py:lamb", N=10))
                if x.name == "fuse(RS-C-AG)-AR-C-AG")
    with pytest.raises(ScheduleError, match=r"sum\(\.\.\.\)` is not an elementwise value sliced along dimension 0"):
        lamb.algorithm(lamb.stages[0], "ring")
    plain = Schedule(load_example("adam.py:adam", N=10))
    with pytest.raises(ScheduleError, match="only collective stages"):
        plain.algorithm(plain.stages[-1], "ring")  # the computation
    p = cw.Program("ada")
    g = p.tensor("g", (4,), "float32", cw.Local)
    p.output(cw.all_reduce(g, "adasum") * 2.0)
    ada = Schedule(p)
    with pytest.raises(ScheduleError, match="reduces with 'adasum'"):
        ada.algorithm(ada.stages[0], "ring")


def test_ring_stages_cannot_then_be_overlapped_or_rewritten():
    mp = load_example("model_parallel.py:layer", B=2, S=4, H=8)
    s = Schedule(mp)
    ar = s.algorithm(s.find("all_reduce")[0], "ring")
    with pytest.raises(ScheduleError, match="already runs on the ring algorithm"):
        s.overlap(s.find("matmul")[0], ar, chunks=2)
    with pytest.raises(ScheduleError, match="split must come before fuse and overlap and algorithm choices"):
        s.split(ar)
