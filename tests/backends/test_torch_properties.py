"""Equivalence on the torch backend: random well-typed programs x random legal schedules, run as generated
code on live Gloo ranks, equal the unscheduled program on the reference backend (the same generators as
tests/schedule/test_equivalence_properties.py, which checks the reference backend)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.ir.loader import import_module_file

# programs() and schedules() of the reference-backend property tests (tests are not a package)
_generators = import_module_file("_equivalence_generators", str(Path(__file__).parents[1] / "schedule" /
                                                                "test_equivalence_properties.py"))
programs, schedules = _generators.programs, _generators.schedules


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), world_size=st.sampled_from([2, 3]))
def test_random_schedules_of_random_programs_equal_the_program_on_the_torch_backend(local_world, data, world_size):
    program = data.draw(programs())
    chosen = [data.draw(schedules(program)) for _ in range(2)]
    rows = check_schedules(program, chosen, world_size, seed=data.draw(st.integers(0, 100)),
                           batch=torch_runner(local_world(world_size)))
    bad = [(r.schedule, r.max_abs, r.error) for r in rows if not r.ok]
    assert not bad, f"{program}\n{[s.steps for s in chosen]}\n{bad}"


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_schedules_of_random_programs_equal_the_program_compiled(local_world, data):
    """The same, with every fused stage compiled into one loop (the CPU default for users)."""
    program = data.draw(programs())
    chosen = [data.draw(schedules(program)) for _ in range(2)]
    rows = check_schedules(program, chosen, 2, seed=data.draw(st.integers(0, 100)),
                           batch=torch_runner(local_world(2), kernels="compiled"))
    bad = [(r.schedule, r.max_abs, r.error) for r in rows if not r.ok]
    assert not bad, f"{program}\n{[s.steps for s in chosen]}\n{bad}"
