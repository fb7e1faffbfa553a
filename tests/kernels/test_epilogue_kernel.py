"""The fused bias + dropout + residual epilogue: values against an fp32 reference, masks against the spec."""

import math

import pytest
import torch

from cocoweave import rng
from cocoweave.kernels import bias_dropout_residual

SHAPE = (3, 10, 37)


def sliced(shape: tuple[int, ...], dim: int, offset: int, size: int) -> tuple[slice, ...]:
    return tuple(slice(offset, offset + size) if d == dim else slice(None) for d in range(len(shape)))


def reference(x, bias, residual, p, seed, rank, index) -> torch.Tensor:
    """fp32 arithmetic on the upcast inputs with the spec's mask."""
    y = x.float() + (0 if bias is None else bias.float())
    return rng.dropout(y, index, p, seed, rank) + residual.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p, with_bias", [(0.0, True), (0.1, True), (0.5, False)])
def test_values(dtype: torch.dtype, p: float, with_bias: bool) -> None:
    x, residual = torch.randn(SHAPE).to(dtype), torch.randn(SHAPE).to(dtype)
    bias = torch.randn(SHAPE[-1]).to(dtype) if with_bias else None
    out = torch.full_like(x, math.nan)
    got = bias_dropout_residual(x, bias, residual, p, seed=5, out=out, block=256)
    assert got is out and got.dtype == dtype
    expect = reference(x, bias, residual, p, 5, rng.NO_RANK, rng.logical_index(SHAPE))
    # fp32 exactly up to rounding order; fp16/bf16 within one unit in the last place of the stored value
    # (the interpreter truncates to bf16 where the GPU rounds to nearest)
    eps = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), expect, rtol=eps, atol=1e-6)


@pytest.mark.parametrize("rank", [rng.NO_RANK, 3])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_mask_of_slices_is_the_logical_mask(dim: int, rank: int) -> None:
    full = rng.logical_index(SHAPE)
    n = SHAPE[dim]
    for offset, size in [(0, n), (1, 2), (n - 3, 3), (n // 2, 1)]:
        sl = sliced(SHAPE, dim, offset, size)
        x = torch.ones(full[sl].shape)  # out = scale where kept, 0 where dropped
        out = bias_dropout_residual(x, None, torch.zeros_like(x), 0.3, seed=9, rank=rank, dim=dim,
                                    offset=offset, full_size=n, block=128)
        keep = rng.keep_mask(full[sl], rng.dropout_key(9, rank), rng.keep_threshold(0.3))
        assert torch.equal(out != 0, keep), (dim, offset)


def test_sliced_bias_and_values_on_a_slice() -> None:
    x_full, r_full, b_full = torch.randn(SHAPE), torch.randn(SHAPE), torch.randn(SHAPE[-1])
    sl = sliced(SHAPE, 2, 5, 11)
    x, r, b = x_full[sl].contiguous(), r_full[sl].contiguous(), b_full[5:16].contiguous()
    got = bias_dropout_residual(x, b, r, 0.2, seed=1, dim=-1, offset=5, full_size=SHAPE[-1])
    expect = reference(x_full, b_full, r_full, 0.2, 1, rng.NO_RANK, rng.logical_index(SHAPE))[sl]
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)


def test_index_wraps_mod_2_32() -> None:
    """A slice of a logical [2, 2^30, 8] tensor (2^34 elements): indices past 2^32 wrap as in the spec."""
    full_size, offset = 2**30, 2**30 - 5
    x = torch.ones(2, 4, 8)
    out = bias_dropout_residual(x, None, torch.zeros_like(x), 0.5, seed=2, dim=1, offset=offset,
                                full_size=full_size)
    a, j, c = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(8), indexing="ij")
    index = a * (full_size * 8) + (offset + j) * 8 + c
    assert index.max() > 2**32
    assert torch.equal(out != 0, rng.keep_mask(index, rng.dropout_key(2), rng.keep_threshold(0.5)))


def test_rejects_bad_arguments() -> None:
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="bias"):
        bias_dropout_residual(x, torch.randn(4), x, 0.1, 0)
    with pytest.raises(ValueError, match="exceeds"):
        bias_dropout_residual(x, None, x, 0.1, 0, dim=0, offset=2, full_size=5)
    with pytest.raises(ValueError, match="probability"):
        bias_dropout_residual(x, None, x, 1.0, 0)


def test_result_dtype_promotes_like_the_torch_path() -> None:
    """bf16 x with an fp32 residual gives fp32, as `dropout(x + bias) + residual` in torch does."""
    x, bias = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    residual = torch.randn(4, 8)
    out = bias_dropout_residual(x, bias, residual, 0.0, seed=0)
    expected = x + bias + residual
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, reference(x, bias, residual, 0.0, 0, rng.NO_RANK, None))


def test_tensors_on_the_wrong_device_are_refused_with_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    from baselines import adam_step

    from cocoweave.kernels import multi_tensor

    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one device; got .* on meta beside"):
        bias_dropout_residual(x, torch.randn(8, device="meta"), x, 0.1, seed=0)
    monkeypatch.setattr(multi_tensor, "interpreted", lambda: False)  # a real launch: CPU pointers are refused
    with pytest.raises(ValueError, match="runs on GPU tensors"):
        bias_dropout_residual(x, None, x, 0.1, seed=0)
    with pytest.raises(ValueError, match="runs on GPU tensors"):
        adam_step(*(torch.zeros(8) for _ in range(4)), lr=1e-3, step=1)
