"""cocoweave.nn's layers initialise as torch.nn layers do: each rank draws only its part of the weight, with the
values of the whole single-process layer, at every tensor-parallel size; reset_parameters, meta + to_empty."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoweave.errors import ParallelConfigError
from cocoweave.nn import (
    ColumnParallelLinear,
    ReferenceBlock,
    RowParallelLinear,
    TransformerBlock,
    full_linear_weights,
    resolve_group,
)
from cocoweave.nn import init as nn_init
from cocoweave.nn.functional import part
from cocoweave.sharding import local


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), data=st.data())
def test_any_block_has_the_values_of_the_whole_tensor(rows, cols, data):
    saved, nn_init.TILE = nn_init.TILE, 7  # small tiles: small tensors span several
    try:
        _check_block(rows, cols, data)
    finally:
        nn_init.TILE = saved


def _check_block(rows: int, cols: int, data: st.DataObject) -> None:
    r0, c0 = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
    r1, c1 = data.draw(st.integers(r0 + 1, rows)), data.draw(st.integers(c0 + 1, cols))
    whole = nn_init.partitioned_uniform_(torch.empty(rows, cols), (rows, cols), (0, 0), 0.5, seed=3)
    block = nn_init.partitioned_uniform_(torch.empty(r1 - r0, c1 - c0), (rows, cols), (r0, c0), 0.5, seed=3)
    assert torch.equal(block, whole[r0:r1, c0:c1])
    vec = nn_init.partitioned_uniform_(torch.empty(rows), (rows,), (0,), 0.5, seed=3)
    assert torch.equal(nn_init.partitioned_uniform_(torch.empty(r1 - r0), (rows,), (r0,), 0.5, seed=3), vec[r0:r1])


def test_a_part_draws_only_the_tiles_it_touches(monkeypatch):
    drawn = []
    monkeypatch.setattr(nn_init, "TILE", 4)
    monkeypatch.setattr(nn_init, "mix_seed", lambda *key: drawn.append(key) or 1)
    nn_init.partitioned_uniform_(torch.empty(16, 4), (16, 16), (0, 4), 0.1, seed=0)  # rank 1 of 4's columns
    assert len(drawn) == 4  # 4 of the 16 tiles


def test_full_weights_have_torch_nn_linear_distribution():
    w, b = full_linear_weights(400, 300, True, seed=1)
    bound = 1 / 400 ** 0.5
    assert w.shape == (300, 400) and b.shape == (300,)
    assert w.abs().max() <= bound and b.abs().max() <= bound
    assert abs(w.mean()) < 0.01 * bound and abs(w.std() - bound / 3 ** 0.5) < 0.01 * bound
    assert not torch.equal(w, full_linear_weights(400, 300, True, seed=2)[0])
    assert not torch.equal(w[:, :300], b.expand(300, 300))  # weight and bias: separate streams


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k]
                                          for k, v in sa.items())


def init_case(rank: int, world_size: int, mesh: bool) -> dict[str, bool]:
    """Layers and a block built directly (from a ProcessGroup or a DeviceMesh), and on meta then materialised, hold
    this rank's part of the single-process layers' weights."""
    group = None
    if mesh and world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    t, r = world_size, rank
    out: dict[str, bool] = {}
    ref = ReferenceBlock(24, 4, dropout=0.1, seed=9)
    blk = TransformerBlock(24, 4, dropout=0.1, seed=9, group=group)
    for i, (name, dim) in enumerate((("qkv", 0), ("proj", 1), ("fc1", 0), ("fc2", 1))):
        full = getattr(ref, name)
        w, b = full_linear_weights(full.in_features, full.out_features, True, 9 + i)
        layer = getattr(blk, name)
        out[f"{name} = ReferenceBlock's part"] = torch.equal(local(layer.weight), part(full.weight, dim, t, r))
        out[f"{name} = full_linear_weights' part"] = torch.equal(local(layer.weight), part(w, dim, t, r)) and \
            torch.equal(local(layer.bias), part(b, 0, t, r) if dim == 0 else b)
    meta = TransformerBlock(24, 4, dropout=0.1, seed=9, group=group, device="meta")
    out["meta has no data"] = meta.qkv.weight.is_meta
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    out["meta + to_empty + reset_parameters = built directly"] = _same_state(meta, blk)
    with torch.no_grad():
        blk.fc1.weight.zero_()
    blk.fc1.reset_parameters()
    out["reset_parameters draws the same values again"] = _same_state(meta, blk)
    col = ColumnParallelLinear(10, 7, seed=4, group=group)  # 7 rows: uneven parts at tp 2 and 4
    row = RowParallelLinear(7, 10, seed=4, group=group)
    w, b = full_linear_weights(10, 7, True, 4)
    out["uneven column parts"] = torch.equal(local(col.weight), part(w, 0, t, r)) and \
        torch.equal(local(col.bias), part(b, 0, t, r))
    w, b = full_linear_weights(7, 10, True, 4)
    out["uneven row parts"] = torch.equal(local(row.weight), part(w, 1, t, r)) and torch.equal(local(row.bias), b)
    out["group from the mesh"] = (dist.get_world_size(col.group) if dist.is_initialized() else 1) == world_size
    return out


@pytest.mark.parametrize("mesh", [False, True])
def test_each_rank_initialises_its_part_of_the_single_process_layers(local_world, mesh):
    for per_rank in ([init_case(0, 1, mesh)], local_world(2).run(init_case, mesh), local_world(4).run(init_case, mesh)):
        for rank, checks in enumerate(per_rank):
            assert all(checks.values()), f"rank {rank}: {[k for k, ok in checks.items() if not ok]}"


def test_a_mesh_without_a_tp_dim_is_one_sentence(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    class FakeMesh(DeviceMesh):
        def __init__(self) -> None:  # no process group needed to ask for its dims
            pass

        mesh_dim_names = ("dp", "pp")
        ndim = 2

    with pytest.raises(ParallelConfigError, match="has no 'tp' dim"):
        resolve_group(FakeMesh())
