"""The experts of an expert-parallel MoE layer (dispatch all_to_all, SwiGLU expert GEMMs, combine all_to_all) equal
one process of plain torch, and every schedule the tool enumerates for them (the overlapped dispatch/experts/combine
chains) equals the program as written on the reference backend and on the torch backend (hypothesis over sizes)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cocoweave import workloads
from cocoweave.backends import reference
from cocoweave.backends.inputs import gather_logical, make_inputs
from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.equivalence.compare import compare, logical_inputs
from cocoweave.schedule.enumerate import enumerate_schedules


def experts_torch(x, w1, w3, w2):
    """Each expert e applies w2[e] (silu(x w1[e]) * (x w3[e])) to its tokens x[:, e], one expert at a time."""
    out = torch.empty_like(x)
    for e in range(x.shape[1]):
        t = x[:, e]
        out[:, e] = (torch.nn.functional.silu(t @ w1[e]) * (t @ w3[e])) @ w2[e]
    return out


@pytest.mark.parametrize(("world", "sizes"), [(1, {}), (2, {}), (4, dict(R=4, E=8, C=3)),
                                              (3, dict(R=3, E=5, C=4, D=6, F=7))])  # experts that do not divide
def test_the_experts_equal_one_process_of_torch(world, sizes):
    program = workloads.moe_experts(**sizes)
    ins = make_inputs(program, world, seed=world)
    res = reference.run(program, ins)
    v = logical_inputs(program, ins)
    got = gather_logical(program.outputs[0][1], [r.outputs["y"] for r in res])
    d = compare(got, experts_torch(v["x"], v["w1"], v["w3"], v["w2"]))
    assert d.ok, d


def test_the_overlapped_dispatch_experts_combine_chain_is_enumerated():
    names = [s.name for s in enumerate_schedules(workloads.moe_experts())]
    assert {"ol(A2A,MM,MM,C,MM,A2A,2)", "ol(A2A,MM,2)-MM-C-MM-A2A", "A2A-MM-MM-C-ol(MM,A2A,4)"} <= set(names)


SIZES = st.fixed_dictionaries({"R": st.integers(1, 4), "E": st.integers(1, 6), "C": st.integers(1, 9),
                               "D": st.integers(1, 6), "F": st.integers(1, 6)})


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=SIZES, world=st.integers(1, 4), seed=st.integers(0, 100))
def test_every_schedule_equals_the_program_on_the_reference(sizes, world, seed):
    program = workloads.moe_experts(**sizes)
    rows = check_schedules(program, enumerate_schedules(program), world, seed=seed)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=SIZES, seed=st.integers(0, 100))
def test_every_schedule_equals_the_program_on_the_torch_backend(local_world, sizes, seed):
    program = workloads.moe_experts(**sizes)
    rows = check_schedules(program, enumerate_schedules(program), 2, seed=seed, batch=torch_runner(local_world(2)))
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
