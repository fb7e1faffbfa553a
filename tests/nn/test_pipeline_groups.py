"""parallel_mesh / parallel_groups: a dp x pp x tp DeviceMesh in Megatron's order on live Gloo ranks, and one
sentence when the world does not divide."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cocoweave.errors import ParallelConfigError
from cocoweave.nn import mesh_coords, parallel_groups, parallel_mesh
from cocoweave.nn.groups import mesh_shape


def mesh_case(rank: int, world_size: int, tp: int, pp: int) -> dict[str, object]:
    mesh = parallel_mesh(tensor_parallel=tp, pipeline_parallel=pp)
    tp_group, dp_group = parallel_groups(tp, pp)
    return {"ranks": {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in ("dp", "pp", "tp")},
            "coord": tuple(mesh.get_coordinate()), "cached": parallel_mesh(tp, pp) is mesh,
            "groups": (dist.get_process_group_ranks(tp_group), dist.get_process_group_ranks(dp_group))}


def bad_case(rank: int, world_size: int) -> str:
    with pytest.raises(ParallelConfigError) as e:
        parallel_mesh(tensor_parallel=3)
    return str(e.value)


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 2)])
def test_mesh_is_megatron_order(world4, tp: int, pp: int) -> None:
    for rank, got in enumerate(world4.run(mesh_case, tp, pp)):
        dp_c, pp_c, tp_c = mesh_coords(rank, tp, pp)
        assert got["coord"] == (dp_c, pp_c, tp_c)
        assert rank == (dp_c * pp + pp_c) * tp + tp_c
        assert got["ranks"]["tp"] == [rank - tp_c + i for i in range(tp)]
        assert got["ranks"]["pp"] == [(dp_c * pp + s) * tp + tp_c for s in range(pp)]
        assert got["groups"] == (got["ranks"]["tp"], got["ranks"]["dp"])
        assert got["cached"]


def test_world_that_does_not_divide_is_one_sentence(world4) -> None:
    said = "tensor_parallel=3 x pipeline_parallel=1 = 3 ranks does not divide the world size 4"
    assert world4.run(bad_case)[0] == said
    with pytest.raises(ParallelConfigError, match="pipeline_parallel must be a positive integer"):
        mesh_shape(4, 1, 0)
    assert mesh_shape(8, 2, 2) == (2, 2, 2)
