"""cocoweave.nn on live Gloo ranks: forward, input gradients and weight gradients equal those of a
single-process model built from the same full weights with the same dropout seed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cocoweave import rng
from cocoweave.errors import ParallelConfigError
from cocoweave.nn import (
    ColumnParallelLinear,
    PipelineBoundary,
    ReferenceBlock,
    RowParallelLinear,
    TransformerBlock,
    bias_dropout_residual,
    new_group,
)
from cocoweave.nn.functional import part
from cocoweave.sharding import local

TOL = 1e-5


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _ref_dropout(y: torch.Tensor, p: float, seed: int, offset: int = 0) -> torch.Tensor:
    index = torch.arange(offset, offset + y.numel()).reshape(y.shape)
    return rng.dropout(y, index, p, seed)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = local(a), local(b)  # a tensor-parallel parameter's gradient is a DTensor: this rank's part
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def mlp_case(rank: int, world_size: int, chunks: int, split_input_here: bool) -> dict[str, float]:
    """Column(gather_output or not) -> gelu -> Row with the fused epilogue, against nn.Linear + rng dropout."""
    torch.manual_seed(0)
    d, f, p, seed, offset = 16, 24 if not split_input_here else 32, 0.25, 7, 5
    fc1, fc2 = nn.Linear(d, f), nn.Linear(f, d)
    x = torch.randn(3, 5, d)
    xr = x.clone().requires_grad_(True)
    ref = _ref_dropout(fc2(F.gelu(fc1(xr))), p, seed, offset) + xr
    ref.square().sum().backward()

    col = ColumnParallelLinear.from_linear(fc1, gather_output=split_input_here)
    row = RowParallelLinear.from_linear(fc2, input_is_parallel=not split_input_here, dropout=p,
                                        overlap_chunks=chunks)
    xp = x.clone().requires_grad_(True)
    out = row(F.gelu(col(xp)), residual=xp, dropout_seed=seed, index_offset=offset)
    out.square().sum().backward()
    t, r = world_size, rank
    return {
        "out": _err(out, ref), "x.grad": _err(xp.grad, xr.grad),
        "fc1.w": _err(col.weight.grad, part(fc1.weight.grad, 0, t, r)),
        "fc1.b": _err(col.bias.grad, part(fc1.bias.grad, 0, t, r)),
        "fc2.w": _err(row.weight.grad, part(fc2.weight.grad, 1, t, r)),
        "fc2.b": _err(row.bias.grad, fc2.bias.grad),
    }


def block_case(rank: int, world_size: int, chunks: int) -> dict[str, float]:
    """TransformerBlock (heads split) against ReferenceBlock, dropout on, at a data-parallel index offset."""
    torch.manual_seed(1)
    ref = ReferenceBlock(16, 4, dropout=0.2, seed=3)
    x = torch.randn(2, 6, 16)
    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr, step=4, index_offset=192)
    y_ref.square().sum().backward()
    blk = TransformerBlock(16, 4, dropout=0.2, overlap_chunks=chunks).load_reference(ref)
    xp = x.clone().requires_grad_(True)
    y = blk(xp, step=4, index_offset=192)
    y.square().sum().backward()
    t, r = world_size, rank
    errs = {"out": _err(y, y_ref), "x.grad": _err(xp.grad, xr.grad),
            "ln1.w": _err(blk.ln1.weight.grad, ref.ln1.weight.grad),
            "proj.b": _err(blk.proj.bias.grad, ref.proj.bias.grad)}
    for name, dim in (("qkv", 0), ("proj", 1), ("fc1", 0), ("fc2", 1)):
        errs[f"{name}.w"] = _err(getattr(blk, name).weight.grad, part(getattr(ref, name).weight.grad, dim, t, r))
    return errs


def pipeline_case(rank: int, world_size: int, scatter_gather: bool) -> dict[str, float]:
    """Two stages, each tensor-parallel over half the world, joined by a PipelineBoundary."""
    torch.manual_seed(2)
    d, f = 8, 16
    lin = [nn.Linear(d, f), nn.Linear(f, d), nn.Linear(d, f), nn.Linear(f, d)]
    x = torch.randn(4, 3, d)
    xr = x.clone().requires_grad_(True)
    h_ref = lin[1](F.gelu(lin[0](xr))) + xr
    loss_ref = (lin[3](F.gelu(lin[2](h_ref))) + h_ref).square().sum()
    loss_ref.backward()

    t = world_size // 2
    stage, index = divmod(rank, t)
    groups = [new_group(list(range(s * t, (s + 1) * t))) for s in range(2)]
    boundary = PipelineBoundary(peer=(1 - stage) * t + index, group=groups[stage], scatter_gather=scatter_gather)
    first, second = (0, 1) if stage == 0 else (2, 3)
    col = ColumnParallelLinear.from_linear(lin[first], group=groups[stage])
    row = RowParallelLinear.from_linear(lin[second], group=groups[stage])
    errs: dict[str, float] = {}
    if stage == 0:
        xp = x.clone().requires_grad_(True)
        h = row(F.gelu(col(xp)), residual=xp)
        boundary.send_forward(h)
        boundary.recv_backward(h)
        errs["h"] = _err(h, h_ref)
        errs["x.grad"] = _err(xp.grad, xr.grad)
    else:
        h = boundary.recv_forward(h_ref.shape)
        out = row(F.gelu(col(h)), residual=h)
        loss = out.square().sum()
        loss.backward()
        boundary.send_backward(h)
        errs["loss"] = abs(loss.item() - loss_ref.item()) / loss_ref.item()
    errs["w1"] = _err(col.weight.grad, part(lin[first].weight.grad, 0, t, index))
    errs["w2"] = _err(row.weight.grad, part(lin[second].weight.grad, 1, t, index))
    return errs


def _assert_close(per_rank: list[dict[str, float]]) -> None:
    for r, errs in enumerate(per_rank):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {r}: {bad}"


@pytest.mark.parametrize("chunks,split_input_here", [(1, False), (3, True)])
def test_column_row_parallel_match_single_process(local_world, chunks, split_input_here):
    _assert_close([mlp_case(0, 1, chunks, split_input_here)])  # no process group at all
    for n in (2, 4):
        _assert_close(local_world(n).run(mlp_case, chunks, split_input_here))


@pytest.mark.parametrize("chunks", [1, 4])
def test_transformer_block_matches_reference_block(local_world, chunks):
    _assert_close([block_case(0, 1, chunks)])
    for n in (2, 4):
        _assert_close(local_world(n).run(block_case, chunks))


def steps_case(rank: int, world_size: int) -> dict[str, float]:
    """Three training forwards without a step: a fresh mask each time, the same masks as the reference block's."""
    torch.manual_seed(4)
    ref = ReferenceBlock(16, 4, dropout=0.3, seed=5)
    blk = TransformerBlock(16, 4, dropout=0.3).load_reference(ref)
    x = torch.randn(2, 6, 16)
    errs, outs = {}, []
    for i in range(3):
        y_ref, y = ref(x), blk(x)
        errs[f"out{i}"] = _err(y, y_ref)
        outs.append(y)
    errs["fresh masks"] = float(torch.equal(outs[0], outs[1]) or torch.equal(outs[1], outs[2]))
    errs["counted"] = float(blk.dropout_step != 3 or ref.dropout_step != 3)
    blk.eval()
    errs["eval: no dropout, no count"] = float(not torch.equal(blk(x), blk(x)) or blk.dropout_step != 3)
    return errs


def test_blocks_draw_a_fresh_mask_every_training_step_without_a_step_argument(local_world):
    _assert_close([steps_case(0, 1)])
    _assert_close(local_world(2).run(steps_case))


def test_row_parallel_linear_advances_its_seed_unless_given_one():
    torch.manual_seed(3)
    row = RowParallelLinear(8, 8, dropout=0.5, seed=2)
    x = torch.randn(4, 8)
    first, second = row(x), row(x)
    assert not torch.equal(first, second) and row.dropout_step == 2  # a fresh mask each training forward
    assert torch.equal(row(x, dropout_seed=7), row(x, dropout_seed=7)) and row.dropout_step == 2
    row.dropout_step = 0
    assert torch.equal(row(x), first)  # the mask is a function of (seed, dropout_step)
    row.eval()
    assert torch.equal(row(x), row(x)) and row.dropout_step == 1


@pytest.mark.parametrize("scatter_gather", [True, False])
def test_pipeline_boundary_matches_single_process(local_world, scatter_gather):
    for n in (2, 4):
        _assert_close(local_world(n).run(pipeline_case, scatter_gather))


def test_epilogue_backward_uses_the_forward_mask():
    y = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    out = bias_dropout_residual(y, b, None, p=0.5, seed=11, offset=3)
    out.sum().backward()
    kept = out.detach() != 0
    assert 0 < kept.sum() < kept.numel()
    assert torch.equal(y.grad != 0, kept)  # gradients flow exactly where the forward kept elements
    assert torch.allclose(y.grad[kept], torch.full_like(y.grad[kept], 2.0))
    assert torch.allclose(b.grad, y.grad.sum(0))
    again = bias_dropout_residual(y.detach(), b.detach(), None, p=0.5, seed=11, offset=3)
    assert torch.equal(again, out.detach())
    assert torch.equal(bias_dropout_residual(y, b, None, p=0.5, seed=11, training=False), y + b)


def test_bad_configurations_are_one_sentence_errors():
    with pytest.raises(ParallelConfigError, match="heads"):
        TransformerBlock(16, 3)
    with pytest.raises(ParallelConfigError, match="dropout"):
        RowParallelLinear(4, 4, dropout=1.5)
    with pytest.raises(ParallelConfigError, match="full weight"):
        ColumnParallelLinear(4, 6).load_full(torch.zeros(4, 4))


def test_triton_epilogue_draws_the_same_mask_as_the_torch_path():
    """The fused kernel used on CUDA (run here by the Triton interpreter) equals the torch ops at any offset."""
    from cocoweave.nn.functional import epilogue_forward

    y, r, b = torch.randn(6, 40), torch.randn(6, 40), torch.randn(40)
    for offset in (0, 80, 40 * 1000):
        fused = epilogue_forward(y, b, r, 0.3, 9, offset, kernel=True)
        plain = epilogue_forward(y, b, r, 0.3, 9, offset, kernel=False)
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
        assert (fused == r).sum() > 0  # some elements were dropped
