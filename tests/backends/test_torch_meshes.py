"""The torch backend on meshes and uneven shares: process groups per mesh axis, every schedule of the 2-D example,
uneven parts through the library, the ring, the fused ring and shared memory, weighted averages, kept sliced state
gathered back; and random 2-D MLPs x random schedules equal the program as written (hypothesis)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave import workloads
from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.ir.loader import import_module_file, load_example
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule


def _bad(rows):
    return [(r.schedule, r.max_abs, r.error) for r in rows if not r.ok]


def test_every_schedule_of_the_2d_example_runs_on_the_torch_backend(world4):
    program = load_example("tp2d.py:mlp")
    schedules = enumerate_schedules(program)
    rows = check_schedules(program, schedules, 4, batch=torch_runner(world4))
    assert len(rows) == len(schedules) and not _bad(rows)


def _uneven_adam(shares, algorithm):
    p = load_example("adam.py:adam", N=11)
    s = Schedule(p)
    rs, ag = s.split(s.find("all_reduce")[0], 0, shares=shares)
    s.reorder(ag)
    s.as_slice("m", "v")
    if algorithm == "fused-ring":
        stage = s.fuse(*[st for st in s.stages])
        s.algorithm(stage, "ring")
    elif algorithm != "library":
        for st in s.stages:
            if st.kind == "collective":
                s.algorithm(st, algorithm)
    return p, s


def test_uneven_shares_on_every_collective_algorithm(local_world):
    schedules = []
    for algorithm in ("library", "ring", "shm", "fused-ring"):
        p, s = _uneven_adam((3, 1), algorithm)
        schedules.append(s)
    rows = check_schedules(p, schedules, 2, batch=torch_runner(local_world(2)))
    assert not _bad(rows), rows


def test_weighted_average_and_uneven_parts_on_a_mesh(world4):
    p = cw.Program("w")
    p.mesh(dp=2, tp=2)
    g = p.tensor("g", (9, 6), "float32", cw.Layout(dp=cw.Local, tp=cw.Sliced(1, shares=(1, 2))))
    p.output(cw.all_reduce(g, "avg", axis="dp", weights=(5, 1)) * 2.0, "avg")
    p.output(cw.all_gather(cw.reduce_scatter(g, "sum", 0, axis="dp", shares=(2, 1)), axis="dp"), "sum")
    s = Schedule(p)
    s.split(s.find("all_reduce")[0], 0, shares=(1, 3))
    rows = check_schedules(p, [Schedule(p), s], 4, batch=torch_runner(world4))
    assert not _bad(rows), rows


def test_state_kept_sliced_along_one_mesh_axis_is_cut_and_gathered_back(world4):
    p = cw.Program("adam2d")
    p.mesh(dp=2, tp=2)
    cols = cw.Layout(tp=cw.Sliced(1))
    g = p.tensor("g", (7, 6), "float32", cw.Layout(dp=cw.Local, tp=cw.Sliced(1)))
    w, m = p.tensor("w", (7, 6), "float32", cols), p.tensor("m", (7, 6), "float32", cols)
    lr, b1 = p.scalars("lr beta1")
    m1 = p.update(m, b1 * m + (1 - b1) * cw.all_reduce(g, "avg", axis="dp"))
    p.update(w, w - lr * m1)
    s = Schedule(p)
    s.reorder(s.split(s.find("all_reduce")[0], 0, shares=(1, 2))[1])
    s.as_slice("m", "w")
    rows = check_schedules(p, [s], 4, batch=torch_runner(world4))
    assert not _bad(rows), rows


def test_fused_stages_of_mesh_programs_fall_back_from_triton_to_torch_ops(world4):
    program = load_example("tp2d.py:mlp")
    chosen = [s for s in enumerate_schedules(program) if s.name == "AG-MM-C-MM-AR-C"]
    rows = check_schedules(program, chosen, 4, batch=torch_runner(world4, kernels="triton"))
    assert len(rows) == 1 and not _bad(rows)


# -- properties: the 2-D example on the torch backend ---------------------------------------------------------------
mesh_schedules = import_module_file("_mesh_generators", str(Path(__file__).parents[1] / "schedule" /
                                                           "test_mesh_schedules.py")).mesh_schedules


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), b=st.integers(2, 5), s=st.integers(1, 4), h=st.integers(2, 6))
def test_random_schedules_of_the_2d_mlp_equal_the_program_on_the_torch_backend(world4, data, b, s, h):
    program = workloads.mlp_2d(b, s, h)
    chosen = [data.draw(mesh_schedules(program)) for _ in range(2)]
    rows = check_schedules(program, chosen, 4, seed=data.draw(st.integers(0, 100)), batch=torch_runner(world4))
    assert not _bad(rows), f"{[c.steps for c in chosen]}\n{_bad(rows)}"
