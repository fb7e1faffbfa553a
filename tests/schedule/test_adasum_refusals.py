"""Adasum's coefficients need the whole tensor: every transformation that would cut an adasum all_reduce
into pieces is refused with a sentence, and the enumeration never proposes one."""

from __future__ import annotations

import pytest

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.equivalence.compare import compare_results
from cocoweave.errors import ProgramError, ScheduleError
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule
from cocoweave.schedule.steps import Reorder, Split


def program() -> tuple[cw.Program, cw.Value]:
    p = cw.Program("adasum")
    x = p.tensor("x", (8, 4), "float32", cw.Local)
    w = p.tensor("w", (4, 4), "float32", cw.Replicated)
    ar = cw.all_reduce(cw.matmul(x, w), "adasum")
    p.output(ar * 2.0, "o")
    return p, ar


def test_split_and_reorder_of_an_adasum_all_reduce_are_refused():
    p, ar = program()
    s = Schedule(p)
    with pytest.raises(ScheduleError, match=rf"cannot split `{ar.name}`: adasum combines whole tensors"):
        s.split(ar)
    with pytest.raises(ScheduleError, match=rf"cannot reorder `{ar.name}`: it is an? all_reduce, not an all_gather"):
        s.reorder(ar)
    with pytest.raises(ScheduleError, match=r"it reduces with 'adasum', and a ring reduces with one of"):
        s.algorithm(ar, "ring")
    assert s.steps == []  # refused steps leave the schedule as it was


def test_adasum_is_only_for_all_reduce_of_floating_point_tensors():
    p = cw.Program("t")
    with pytest.raises(ProgramError, match="adasum needs a floating-point operand"):
        cw.all_reduce(p.tensor("i", (4,), "int32", cw.Local), "adasum")
    with pytest.raises(ProgramError, match="unknown reduction 'adasum'"):
        cw.reduce_scatter(p.tensor("g", (4,), "float32", cw.Local), "adasum")


def test_overlap_of_an_adasum_all_reduce_is_refused():
    p, ar = program()
    s = Schedule(p)
    mm = s.stages[0]
    with pytest.raises(ScheduleError, match="adasum"):
        s.overlap(mm, s.stage(ar), chunks=2)


def test_every_enumerated_schedule_of_an_adasum_program_keeps_its_results():
    p, _ = program()
    inputs = make_inputs(p, 3, seed=2)
    want = reference.run(p, inputs)
    for s in enumerate_schedules(p):
        assert not any(isinstance(step, (Split, Reorder)) for step in s.steps)
        assert compare_results(p, reference.run(s, inputs), want).ok, s.steps
