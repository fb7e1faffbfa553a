"""enumerate_schedules lists CoCoNet's schedules for the paper's workloads, and each is checked."""

import pytest

from cocoweave.equivalence.check import check_schedules
from cocoweave.ir.loader import load_example
from cocoweave.schedule.enumerate import enumerate_schedules


def example(name, func, **sizes):
    return load_example(f"{name}.py:{func}", **sizes)


def names(p):
    return [s.name for s in enumerate_schedules(p)]


def test_adam_schedules():
    got = names(example("adam", "adam", N=16))
    assert got[0] == "AR-c"  # the program as written comes first: it is the baseline
    for want in ("AR-C", "RS-C-AG", "RS-C-AG+slice(m,v)", "fuse(RS-C-AG)", "fuse(RS-C-AG)+slice(m,v)"):
        assert want in got
    assert len(got) == len(set(got))


def test_model_parallel_and_pipeline_list_overlap_variants():
    mp = names(example("model_parallel", "layer", B=2, S=8, H=16))
    for n in (2, 4, 8):
        assert f"ol(MM,fuse(RS-C-AG),{n})" in mp and f"ol(MM,AR,C,{n})" in mp
    pp = names(example("pipeline_parallel", "boundary", B=2, S=8, H=16))
    assert "RS-C-P2P-AG" in pp and "ol(RS,C,P2P,4)-AG" in pp and "ol(AR,C,P2P,2)" in pp


def test_lamb_schedules_include_inserted_all_reduces():
    got = names(example("lamb", "lamb", N=16))
    assert "RS-C-AR-C-AG+slice(m,v)" in got


@pytest.mark.parametrize("name, func, sizes, worlds", [
    ("adam", "adam", {"N": 37}, range(1, 9)),
    ("lamb", "lamb", {"N": 37}, range(1, 9)),
    ("model_parallel", "layer", {"B": 3, "S": 5, "H": 12}, range(1, 9)),
    ("pipeline_parallel", "boundary", {"B": 3, "S": 5, "H": 12}, (2, 4, 6, 8)),
])
def test_every_schedule_of_every_example_equals_the_program(name, func, sizes, worlds):
    p = example(name, func, **sizes)
    schedules = enumerate_schedules(p)
    for w in worlds:
        rows = check_schedules(p, schedules, w, seed=w)
        bad = [r for r in rows if not r.ok]
        assert not bad, bad


def test_check_catches_a_schedule_that_is_wrong(monkeypatch):
    """The oracle can fail: corrupt one schedule's dropout seed and check must say so."""
    p = example("model_parallel", "layer", B=2, S=4, H=8)
    s = [x for x in enumerate_schedules(p) if x.name == "MM-RS-C-AG"][0]
    drop = next(v for v in s.program.values if v.op == "dropout")
    monkeypatch.setitem(drop.attrs, "seed", 1)
    rows = check_schedules(p, [s], 2)
    assert not rows[0].ok and rows[0].max_abs > 0
