"""Typed schedule steps: every kind prints and round-trips through JSON exactly as schedules and tune caches
saved it before steps were typed, rebuilding a schedule from its steps equals calling the methods, and a
malformed step is refused with a sentence."""

from __future__ import annotations

import hashlib
import json

import pytest

from cocoweave.errors import ScheduleError
from cocoweave.ir.loader import load_example
from cocoweave.schedule.schedule import Schedule
from cocoweave.schedule.steps import STEPS, Algorithm, AsSlice, Fuse, Overlap, Reorder, Split, Step

# Each kind, its JSON dict (the saved form) and its printed form.
KINDS = [
    (Split("%3", dim=1), {"step": "split", "ref": "%3", "dim": 1}, "split(%3, dim=1)"),
    (Reorder("%3.ag"), {"step": "reorder", "ref": "%3.ag"}, "reorder(%3.ag)"),
    (AsSlice("m"), {"step": "as_slice", "name": "m"}, "as_slice(m)"),
    (Fuse(("%1.rs", "%10", "w.ag")), {"step": "fuse", "refs": ["%1.rs", "%10", "w.ag"]}, "fuse(%1.rs, %10, w.ag)"),
    (Overlap(("a", "b"), 4), {"step": "overlap", "refs": ["a", "b"], "chunks": 4}, "overlap(a, b, chunks=4)"),
    (Algorithm("%1.rs", "ring"), {"step": "algorithm", "ref": "%1.rs", "algorithm": "ring"},
     "algorithm(%1.rs, 'ring')"),
]

# The JSON steps of a fixed schedule of examples/adam.py (N=64) that uses every kind adam allows.
ADAM_STEPS = [
    {"step": "split", "ref": "%1", "dim": 0},
    {"step": "reorder", "ref": "%1.ag"},
    {"step": "as_slice", "name": "m"},
    {"step": "as_slice", "name": "v"},
    {"step": "fuse", "refs": ["%1.rs", "%10", "w.ag"]},
    {"step": "algorithm", "ref": "%1.rs", "algorithm": "ring"},
]
# Computed on main at c40ec84, before steps were typed (steps were dicts then): tune caches and saved
# schedules written by that version must keep loading and keep their fingerprints.
ADAM_FINGERPRINT = "355cd4e895082843"
ADAM_TO_JSON_SHA256 = "d3e6289ffa876266bde316f6aa146722d044a2a33220446b42fddc27fa42ba64"


def adam() -> Schedule:
    """The fixed adam schedule, built with the methods."""
    s = Schedule(load_example("adam.py:adam", N=64))
    s.split("%1", dim=0)
    s.reorder("%1.ag")
    s.as_slice("m", "v")
    s.algorithm(s.fuse("%1.rs", "%10", "w.ag"), "ring")
    return s


def model_parallel() -> Schedule:
    """split + reorder + fuse + overlap of the model-parallel layer, built with the methods."""
    s = Schedule(load_example("model_parallel.py:layer", B=2, S=4, H=8))
    _, ag = s.split(s.find("all_reduce")[0])
    s.reorder(ag)
    s.overlap(s.stages[0], s.fuse(*s.stages[1:]), chunks=2)
    return s


@pytest.mark.parametrize(("step", "data", "text"), KINDS, ids=[k[0].kind for k in KINDS])
def test_every_kind_round_trips_through_json_and_prints_as_before(step, data, text):
    assert step.to_json() == data
    assert list(step.to_json()) == list(data)  # key order: the saved JSON text stays byte-for-byte the same
    assert Step.from_json(json.loads(json.dumps(data))) == step
    assert str(step) == text


def test_the_table_has_every_kind_once():
    assert set(STEPS) == {k[0].kind for k in KINDS}
    assert all(STEPS[kind].kind == kind for kind in STEPS)


def test_split_dim_defaults_to_zero_as_in_saved_schedules():
    assert Step.from_json({"step": "split", "ref": "%1"}) == Split("%1", 0)


def test_the_fingerprint_and_json_of_a_fixed_adam_schedule_did_not_change():
    s = adam()
    assert s.name == "fuse(RS-C-AG)@ring+slice(m,v)"
    assert s.steps_json() == ADAM_STEPS
    assert s.fingerprint() == ADAM_FINGERPRINT
    assert hashlib.sha256(s.to_json().encode()).hexdigest() == ADAM_TO_JSON_SHA256
    assert Schedule(s.original, ADAM_STEPS).fingerprint() == ADAM_FINGERPRINT


@pytest.mark.parametrize("build", [adam, model_parallel])
def test_a_schedule_rebuilt_from_its_steps_equals_the_one_the_methods_made(build):
    s = build()
    for steps in (s.steps, s.steps_json(), [x if i % 2 else x.to_json() for i, x in
                                                           enumerate(s.steps)]):
        again = Schedule(s.original, steps)
        assert again.steps == s.steps
        assert (again.name, again.fingerprint(), str(again)) == (s.name, s.fingerprint(), str(s))
        assert again.stages == s.stages
    assert Schedule.from_json(s.to_json(), s.original).fingerprint() == s.fingerprint()


def test_apply_returns_what_the_method_returns():
    by_method, by_step = (Schedule(load_example("model_parallel.py:layer", B=2, S=4, H=8)) for _ in range(2))
    ar = by_method.find("all_reduce")[0].anchor
    assert Split(ar).apply(by_step) == by_method.split(ar)
    assert Reorder(ar + ".ag").apply(by_step) == by_method.reorder(ar + ".ag")
    refs = tuple(x.anchor for x in by_method.stages[1:])
    assert Fuse(refs).apply(by_step) == by_method.fuse(*refs)
    assert by_step.steps == []  # apply does the work; recording is the schedule's job
    assert by_method.steps == [Split(ar), Reorder(ar + ".ag"), Fuse(refs)]


def test_the_methods_record_typed_steps_and_sliced_state_reads_them():
    s = adam()
    assert [type(x) for x in s.steps] == [Split, Reorder, AsSlice, AsSlice, Fuse, Algorithm]
    assert s.sliced_state == ["m", "v"]
    assert model_parallel().steps[-1] == Overlap(("%4", "%5.rs"), 2)


def test_as_slice_of_several_names_is_all_or_nothing():
    s = Schedule(load_example("adam.py:adam", N=64))
    s.split("%1")
    s.reorder("%1.ag")
    before = (s.fingerprint(), str(s.program), s.stages)
    with pytest.raises(ScheduleError, match="cannot store `g` sliced"):
        s.as_slice("m", "g")
    assert (s.fingerprint(), str(s.program), s.stages) == before and s.sliced_state == []


def test_a_rewrite_after_a_grouping_is_refused_when_rebuilding_too():
    steps = [{"step": "algorithm", "ref": "%1", "algorithm": "ring"}, {"step": "split", "ref": "%1", "dim": 0}]
    with pytest.raises(ScheduleError, match="split must come before fuse and overlap and algorithm choices"):
        Schedule(load_example("adam.py:adam", N=64), steps)


@pytest.mark.parametrize(("data", "sentence"), [
    ({"step": "tile", "ref": "%1"}, r"unknown schedule step 'tile' in \{.*\}; the kinds are split, reorder, "
                                    r"as_slice, fuse, overlap, algorithm"),
    ({"ref": "%1"}, r"unknown schedule step None in \{'ref': '%1'\}"),
    (["split", "%1"], r"schedule step \['split', '%1'\] is not a JSON object"),
    ({"step": "split"}, r"schedule step \{'step': 'split'\} lacks its 'ref' field"),
    ({"step": "overlap", "refs": ["a", "b"]}, r"lacks its 'chunks' field"),
    ({"step": "split", "ref": "%1", "dims": 0}, r"has a field 'dims' that a split step does not have \(its fields "
                                                r"are ref, dim, shares\)"),
    ({"step": "split", "ref": 3}, r"schedule step split has ref=3, but its ref must be a string"),
    ({"step": "split", "ref": "%1", "dim": True}, r"schedule step split has dim=True, but its dim must be an integer"),
    ({"step": "fuse", "refs": "%1"}, r"schedule step fuse has refs='%1', but its refs must be a list of strings"),
    ({"step": "fuse", "refs": ["%1", 2]}, r"its refs must be a list of strings"),
    ({"step": "overlap", "refs": ["a", "b"], "chunks": "4"}, r"overlap has chunks='4', but its chunks must be an "
                                                             r"integer"),
    ({"step": "algorithm", "ref": "%1", "algorithm": None}, r"its algorithm must be a string"),
])
def test_unknown_and_malformed_steps_are_refused_with_a_sentence(data, sentence):
    with pytest.raises(ScheduleError, match=sentence):
        Step.from_json(data)
    program = load_example("adam.py:adam", N=64)
    with pytest.raises(ScheduleError, match=sentence):
        Schedule(program, [{"step": "split", "ref": "%1", "dim": 0}, data])
    saved = json.dumps({"program": "adam", "program_fingerprint": program.fingerprint(), "steps": [data]})
    with pytest.raises(ScheduleError, match=sentence):
        Schedule.from_json(saved, program)


def test_steps_built_in_code_are_checked_and_immutable():
    with pytest.raises(ScheduleError, match="schedule step reorder has ref=None, but its ref must be a string"):
        Reorder(None)
    assert Fuse(["a", "b"]) == Fuse(("a", "b")) and hash(Fuse(["a", "b"])) == hash(Fuse(("a", "b")))
    with pytest.raises(AttributeError):
        Split("%1").dim = 1
