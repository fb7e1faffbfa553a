"""all_to_all on the reference backend against plain torch on the logical tensors (the whole tensor is unchanged,
only its slicing moves), and on the torch backend (generated code over Gloo ranks) against the reference: even and
uneven parts, meshes, an MoE-shaped dispatch -> expert -> combine chain, and random programs x random schedules
(hypothesis)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import gather_logical, make_inputs
from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.equivalence.compare import compare, logical_inputs
from cocoweave.ir.loader import import_module_file
from cocoweave.schedule.schedule import Schedule

# the random schedules of the reference-backend property tests (tests are not a package)
schedules = import_module_file("_equivalence_generators", str(Path(__file__).parents[1] / "schedule" /
                                                              "test_equivalence_properties.py")).schedules


def _logical(p, results, name):
    v = dict(p.outputs)[name]
    return gather_logical(v, [r.outputs[name] for r in results if name in r.outputs])


def _moe(tokens=(2, 4, 3, 5), shares=None, back=True):
    """Tokens [source rank, expert, capacity, d] sliced by source; dispatch slices them by expert, each rank scales
    its experts' tokens, combine slices them by source again."""
    p = cw.Program("moe")
    x = p.tensor("x", tokens, "float32", cw.Sliced(0))
    w = p.tensor("w", (tokens[1], 1, tokens[3]), "float32")
    mine = cw.all_to_all(x, 1, shares=shares)
    y = mine * w + 1.0
    p.output(cw.all_to_all(y, 0) if back else y, "y")
    return p


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_whole_tensor_is_unchanged_and_each_rank_keeps_its_part_of_the_new_dimension(world):
    p = cw.Program("t")
    x = p.tensor("x", (7, 5, 3), "float32", cw.Sliced(0))
    y = cw.all_to_all(x, 1)
    p.output(y, "y")
    p.output(cw.all_to_all(y, 2), "z")
    ins = make_inputs(p, world, seed=1)
    res = reference.run(p, ins)
    whole = logical_inputs(p, ins)["x"]
    assert [tuple(r.outputs["y"].shape) for r in res] == [(7, len(c), 3) for c in torch.arange(5).tensor_split(world)]
    for r in range(world):
        assert torch.equal(res[r].outputs["y"], whole.tensor_split(world, 1)[r])
    assert torch.equal(_logical(p, res, "z"), whole)


def test_uneven_parts_follow_the_shares_on_both_sides():
    p = cw.Program("t")
    x = p.tensor("x", (6, 8), "float32", cw.Sliced(0, shares=(2, 1)))
    p.output(cw.all_to_all(x, 1, shares=(1, 3)), "y")
    ins = make_inputs(p, 2)
    res = reference.run(p, ins)
    whole = logical_inputs(p, ins)["x"]
    assert [tuple(t["x"].shape) for t in ins] == [(4, 8), (2, 8)]
    assert torch.equal(res[0].outputs["y"], whole[:, :2]) and torch.equal(res[1].outputs["y"], whole[:, 2:])


def test_on_a_mesh_it_exchanges_along_one_axis_only():
    p = cw.Program("t")
    p.mesh(ep=2, dp=2)
    x = p.tensor("x", (4, 6, 2), "float32", cw.Layout(ep=cw.Sliced(0), dp=cw.Local))
    p.output(cw.all_to_all(x, 1, axis="ep"), "y")
    ins = make_inputs(p, 4, seed=3)
    res = reference.run(p, ins)
    for r in range(4):
        e, d = divmod(r, 2)  # ep coordinate, dp coordinate: the ep line through r is {d, 2 + d}
        whole = torch.cat([ins[d]["x"], ins[2 + d]["x"]], 0)
        assert torch.equal(res[r].outputs["y"], whole.tensor_split(2, 1)[e])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dispatch_expert_combine_equals_the_single_process_computation(world):
    p = _moe()
    ins = make_inputs(p, world, seed=world)
    v = logical_inputs(p, ins)
    res = reference.run(p, ins)
    d = compare(_logical(p, res, "y"), v["x"] * v["w"] + 1.0)
    assert d.ok, d


def test_the_torch_backend_equals_the_reference(local_world):
    programs = [_moe(), _moe(shares=(3, 1), back=False), _moe((3, 5, 2, 4))]
    for p in programs:
        rows = check_schedules(p, [Schedule(p)], 2, batch=torch_runner(local_world(2)))
        assert all(r.ok for r in rows), rows
    rows = check_schedules(programs[2], [Schedule(programs[2])], 3, batch=torch_runner(local_world(3)))
    assert all(r.ok for r in rows), rows


def test_the_torch_backend_on_a_mesh_and_in_a_world_of_one(local_world):
    p = cw.Program("t")
    p.mesh(ep=2, dp=2)
    x = p.tensor("x", (4, 6, 5), "float32", cw.Layout(ep=cw.Sliced(0), dp=cw.Sliced(2, shares=(2, 1))))
    y = cw.all_to_all(x, 1, axis="ep", shares=(1, 2))
    p.output(cw.all_gather(y * 2.0, axis="dp"), "y")
    rows = check_schedules(p, [Schedule(p)], 4, batch=torch_runner(local_world(4)))
    assert all(r.ok for r in rows), rows
    one = _moe()
    rows = check_schedules(one, [Schedule(one)], 1, batch=torch_runner(local_world(1)))
    assert all(r.ok for r in rows), rows


@st.composite
def programs(draw):
    """A tensor sliced along one dimension, moved to another by all_to_all, computed on, maybe moved again and
    gathered; shapes that do not split evenly, uneven shares."""
    shape = tuple(draw(st.integers(1, 7)) for _ in range(3))
    src, dst = draw(st.permutations(range(3)))[:2]
    p = cw.Program("random_a2a")
    x = p.tensor("x", shape, "float32", cw.Sliced(src))
    r = p.tensor("r", shape[-1:], "float32")
    shares = draw(st.sampled_from([None, (1, 2), (3, 1)]))
    y = cw.all_to_all(x, dst, shares=shares)
    y = draw(st.sampled_from([lambda t: t * r, lambda t: cw.exp(t) - r, lambda t: t + 1.0]))(y)
    if draw(st.booleans()):
        y = cw.all_to_all(y, draw(st.sampled_from([d for d in range(3) if d != dst])))
    if draw(st.booleans()):
        y = cw.all_gather(y)
    p.output(y, "out")
    return p, shares


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_schedules_of_all_to_all_programs_are_equivalent_on_the_reference(data):
    program, shares = data.draw(programs())
    world = 2 if shares else data.draw(st.integers(1, 4))
    chosen = [data.draw(schedules(program)) for _ in range(2)]
    rows = check_schedules(program, chosen, world, seed=data.draw(st.integers(0, 100)))
    assert all(r.ok for r in rows), f"{program}\n{rows}"


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_schedules_of_all_to_all_programs_are_equivalent_on_the_torch_backend(local_world, data):
    program, _ = data.draw(programs())
    chosen = [data.draw(schedules(program)) for _ in range(2)]
    rows = check_schedules(program, chosen, 2, seed=data.draw(st.integers(0, 100)),
                           batch=torch_runner(local_world(2)))
    assert all(r.ok for r in rows), f"{program}\n{[s.steps for s in chosen]}\n{rows}"
