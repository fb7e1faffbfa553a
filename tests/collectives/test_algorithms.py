"""A collective algorithm is one registration in the table (cocoweave.collectives): a "naive" all-reduce (gather
every rank's tensor, sum) registered here is enumerated, checked, generated and run by the torch backend, priced by
the cost model with its own traffic, and picked by the optimizer's automatic choice; then removed. An algorithm
the table does not know is a cocoweave error wherever it is met, never a silent fallback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import cocoweave.optim.schedule_choice as schedule_choice
import cocoweave.tune as tune
from cocoweave import collectives
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.codegen import generate
from cocoweave.backends.torch.worker import run_schedules
from cocoweave.equivalence.compare import compare_results
from cocoweave.errors import CocoweaveError, ScheduleError
from cocoweave.ir.loader import load_example
from cocoweave.perf.costmodel import AlphaBeta, Calibration, PlanCoster, predict_plan
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule


def naive_all_reduce(ctx: Any, x: torch.Tensor, op: str, group: Any, out: Any) -> torch.Tensor:
    """Every rank gathers every rank's whole tensor and sums them (p - 1 tensors received per rank)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    total = torch.stack(parts).sum(0)
    return ctx.buffer(out, x.shape, x.dtype).copy_(total / len(parts) if op == "avg" else total)


def _register() -> collectives.Algorithm:
    """The one registration: the table's entry and the torch backend's implementation."""
    return collectives.register(
        collectives.Algorithm("naive", ("all_reduce",), ("sum", "avg"), enumerated=(("written", ("collective",)),),
                              auto="preferred",
                              traffic=lambda op, p: float(p - 1) if op == "all_reduce" else collectives.moved(op, p)),
        {"torch": {"all_reduce": naive_all_reduce}})


@pytest.fixture
def naive(monkeypatch) -> Iterator[collectives.Algorithm]:
    monkeypatch.setattr(tune, "cached_schedule", lambda *a, **k: None)  # no tuner's choice from an earlier run
    algorithm = _register()
    try:
        yield algorithm
    finally:
        collectives.unregister("naive")


def _adam():
    return load_example("adam.py:adam", N=16)


def _on_naive(program) -> Schedule:
    return next(s for s in enumerate_schedules(program) if s.name == "AR@naive-C")


def test_enumeration_and_legality_see_the_new_algorithm(naive):
    names = [s.name for s in enumerate_schedules(_adam())]
    assert "AR@naive-C" in names and names.index("AR@naive-C") > names.index("AR@shm-C")  # after those before it
    split = next(s for s in enumerate_schedules(_adam()) if s.name == "RS-AG-C")
    with pytest.raises(ScheduleError, match="cannot run RS .* as a naive: only all_reduce have one"):
        split.algorithm(split.stages[0], "naive")


def test_the_table_forgets_it_when_it_is_removed():
    _register()
    collectives.unregister("naive")
    assert "naive" not in collectives.names()
    assert not any("@naive" in s.name for s in enumerate_schedules(_adam()))
    with pytest.raises(ScheduleError, match="unknown collective algorithm 'naive'"):
        Schedule(_adam()).algorithm("%1", "naive")


def test_codegen_calls_the_registered_implementation(naive):
    source = generate(lower(_on_naive(_adam())), 0, 2, {})
    assert "ctx.naive_all_reduce(" in source and "ctx.all_reduce(" not in source


def _run_naive(rank: int, world_size: int, doc: dict, inputs: Any) -> Any:
    """On a rank: the same one registration, the schedule rebuilt and run, the algorithm removed again."""
    _register()
    try:
        program = _adam()
        return run_schedules(rank, world_size, [Schedule.from_json(doc, program)], inputs, {})[0]
    finally:
        collectives.unregister("naive")


def test_the_torch_backend_runs_it_and_it_equals_the_program(naive, local_world):
    program = _adam()
    inputs = make_inputs(program, 2, {}, seed=5)
    want = reference.run(program, inputs, {}, whole_state=True)
    got = local_world(2).run(_run_naive, _on_naive(program).to_json(), inputs)
    assert compare_results(program, got, want).ok


def test_the_cost_model_prices_it_with_its_own_traffic(naive):
    cal = Calibration("torch", "cpu", 4, {"all_reduce/library": AlphaBeta(0.0, 1.0)}, {}, {})
    found = {s.name: s for s in enumerate_schedules(_adam())}
    terms = {}
    for name in ("AR-C", "AR@naive-C"):
        plan = lower(found[name])
        terms[name] = PlanCoster(plan, {}, 4, cal).terms(plan.stages[0])[0]
    assert terms["AR@naive-C"].key == "all_reduce/naive"  # priced on the library's line: it has none of its own
    assert terms["AR@naive-C"].amount == pytest.approx(terms["AR-C"].amount * 3 / 1.5)  # (p - 1) against 2(p - 1)/p
    assert cal.collective("all_reduce", "naive") == AlphaBeta(0.0, 1.0)


def test_the_optimizers_automatic_choice_asks_the_table(naive):
    program = _adam()
    whole = set(program.updates)  # nothing sliced: the choice is between algorithms
    assert schedule_choice.resolve_schedule(program, "auto", 2, whole, "cpu", shared_host=False).name == "AR@naive-C"
    collectives.unregister("naive")
    collectives.register(replace(naive, auto="never"))
    assert schedule_choice.resolve_schedule(program, "auto", 2, whole, "cpu", shared_host=False).name == "AR-C"


def test_an_unknown_algorithm_is_an_error_not_a_fallback():
    plan = lower(Schedule(_adam()))
    bogus = replace(plan, stages=[replace(plan.stages[0], algorithm="bogus"), *plan.stages[1:]])
    cal = Calibration("torch", "cpu", 4, {"all_reduce/library": AlphaBeta(0.0, 1.0)}, {}, {})
    for call in (lambda: cal.collective("all_reduce", "bogus"), lambda: predict_plan(bogus, {}, 4, cal),
                 lambda: generate(bogus, 0, 2, {})):
        with pytest.raises(collectives.UnknownAlgorithmError, match="unknown collective algorithm 'bogus'"):
            call()


def test_registrations_are_checked():
    with pytest.raises(CocoweaveError, match="'ring' is already registered"):
        collectives.register(collectives.get("ring"))
    with pytest.raises(CocoweaveError, match="the ring algorithm does not implement broadcast"):
        collectives.implement("torch", "ring", broadcast=naive_all_reduce)
    with pytest.raises(collectives.UnknownAlgorithmError, match="no implementation of broadcast on the ring"):
        collectives.implementation("torch", "ring", "broadcast")
    with pytest.raises(CocoweaveError, match="the library algorithm cannot be removed"):
        collectives.unregister("library")
