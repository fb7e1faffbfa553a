"""The MLP block in 1-D, 2-D and 3-D tensor parallelism equals one process of plain torch, and every schedule of
the 2-D and 3-D examples equals the program as written (reference backend)."""

import pytest

from cocoweave import workloads
from cocoweave.backends import reference
from cocoweave.backends.inputs import gather_logical, make_inputs
from cocoweave.equivalence.check import check_schedules
from cocoweave.equivalence.compare import compare, logical_inputs
from cocoweave.ir.loader import load_example
from cocoweave.schedule.enumerate import enumerate_schedules


def block_output(program, world):
    ins = make_inputs(program, world, seed=3)
    res = reference.run(program, ins)
    v = logical_inputs(program, ins)
    out = gather_logical(program.outputs[0][1], [r.outputs["out"] for r in res])
    return out, workloads.mlp_torch(v["x"], v["w1"], v["b1"], v["w2"], v["b2"])


@pytest.mark.parametrize(("build", "world", "sizes"), [
    (workloads.mlp_1d, 4, dict(B=3, S=5, H=6)),
    (workloads.mlp_2d, 4, dict(B=8, S=4, H=8)),
    (workloads.mlp_2d, 9, dict(B=5, S=3, H=7, q=3)),  # sizes that do not divide
    (workloads.mlp_3d, 8, dict(B=4, S=4, H=8)),
    (workloads.mlp_3d, 8, dict(B=3, S=5, H=6)),
])
def test_tensor_parallel_mlp_equals_one_process_of_torch(build, world, sizes):
    out, want = block_output(build(**sizes), world)
    d = compare(out, want)
    assert d.ok, d


def test_the_block_output_keeps_the_input_layout_so_blocks_stack():
    for build in (workloads.mlp_2d, workloads.mlp_3d):
        p = build()
        assert dict(p.outputs)["out"].layout == p.inputs["x"].layout


@pytest.mark.parametrize(("spec", "world", "want"), [
    ("tp2d.py:mlp", 4, {"AG-MM-C-MM-RS-C", "AG-MM-C-ol(MM,AR,4)-C", "AG@ring-MM-C-MM-AR@ring-C"}),
    ("tp3d.py:mlp", 8, {"AG-MM-fuse(RS-C-AG)-MM-RS-C", "AG-MM-fuse(RS-C-AG)@ring-MM-AR-C"}),
])
def test_every_schedule_of_the_mesh_examples_is_equivalent(spec, world, want):
    program = load_example(spec)
    schedules = enumerate_schedules(program)
    assert want <= {s.name for s in schedules}
    rows = check_schedules(program, schedules, world)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_adam_can_weight_the_gradient_average_by_batch_size():
    import torch

    p = workloads.adam(6, weights=(3, 1))
    ins = make_inputs(p, 2, seed=1)
    g = (3 * ins[0]["g"] + ins[1]["g"]) / 4
    plain = workloads.adam(6, grad="reduced")
    want = reference.run(plain, [{**ins[0], "g": g}])[0].state["w"]
    got = reference.run(p, ins)
    assert all(torch.allclose(r.state["w"], want) for r in got)


def test_check_skips_world_sizes_the_mesh_does_not_fit():
    from cocoweave.equivalence.check import world_applicable

    p = load_example("tp2d.py:mlp")
    assert world_applicable(p, 4) is None
    assert "does not fit the mesh x=2, y=2" in world_applicable(p, 8)
