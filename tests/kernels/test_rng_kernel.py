"""The Triton hash against the torch spec in `cocoweave.rng`: bit-identical for any index, seed and rank."""

import pytest
import torch

from cocoweave import rng
from cocoweave.kernels import random_bits


@pytest.mark.parametrize("seed, rank", [(0, rng.NO_RANK), (1, 3), (2**31 + 7, 1), (2**32 - 1, 2**20)])
def test_random_bits_match_spec(seed: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(seed % 1000)
    index = torch.cat([
        torch.arange(1000),  # consecutive indices, as a tensor's elements have
        torch.randint(0, 2**62, (3001,), generator=gen),  # beyond 2^32: only the low 32 bits count
        torch.tensor([2**32 - 1, 2**32, 2**33 + 5]),
    ])
    got = random_bits(index, seed, rank, block=1024)
    assert torch.equal(got, rng.random_bits(index, seed, rank))
    assert got.min() >= 0 and got.max() < 2**32


def test_random_bits_match_python_hash() -> None:
    index = torch.tensor([0, 1, 2, 0x9E3779B9, 2**31, 2**32 - 1])
    key = rng.dropout_key(5, 0)
    expect = [rng.triple32_int(int(i) ^ key) for i in index]
    assert random_bits(index, 5, 0).tolist() == expect
