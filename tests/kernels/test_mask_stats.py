"""Statistics of the dropout mask drawn by the epilogue kernel, each bound at 5 sigma."""

import math

import pytest
import torch

from cocoweave import rng
from cocoweave.kernels import bias_dropout_residual, random_bits

ROWS, COLS = 256, 1024  # 2^18 elements
N = ROWS * COLS


def mask(p: float, seed: int, rank: int = rng.NO_RANK) -> torch.Tensor:
    """The keep-mask as float 0/1, read off the epilogue with x = 1, residual = 0."""
    x = torch.ones(ROWS, COLS)
    out = bias_dropout_residual(x, None, torch.zeros_like(x), p, seed, rank=rank, block=2**16)
    return (out != 0).float()


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_unbiased(p: float) -> None:
    kept = mask(p, seed=11).sum().item()
    assert abs(kept - N * (1 - p)) < 5 * math.sqrt(N * p * (1 - p))


def test_neighbours_uncorrelated() -> None:
    m = mask(0.5, seed=3)
    bound = 5 / math.sqrt(N)
    assert abs(corr(m[:, 1:], m[:, :-1])) < bound  # next element in a row
    assert abs(corr(m[1:], m[:-1])) < bound  # same column, next row


def test_seeds_and_ranks_uncorrelated() -> None:
    bound = 5 / math.sqrt(N)
    assert abs(corr(mask(0.5, seed=1), mask(0.5, seed=2))) < bound
    assert abs(corr(mask(0.5, seed=7, rank=0), mask(0.5, seed=7, rank=1))) < bound
    assert abs(corr(mask(0.5, seed=7, rank=rng.NO_RANK), mask(0.5, seed=8, rank=rng.NO_RANK))) < bound


@pytest.mark.parametrize("shift", [24, 0])
def test_bytes_uniform(shift: int) -> None:
    bits = random_bits(torch.arange(N), seed=123, block=2**16)
    counts = torch.bincount((bits >> shift) & 0xFF, minlength=256).double()
    chi2 = float(((counts - N / 256) ** 2 / (N / 256)).sum())
    assert chi2 < 255 + 5 * math.sqrt(2 * 255)  # chi-square, 255 degrees of freedom
