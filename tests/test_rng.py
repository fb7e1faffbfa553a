"""The dropout hash: exact on int64 tensors, and a sane keep rate."""

import torch

from cocoweave import rng


def test_tensor_hash_equals_integer_hash():
    x = torch.randint(0, 2**32, (1000,), generator=torch.Generator().manual_seed(0))
    x = torch.cat([x, torch.tensor([0, 1, 2**32 - 1])])
    assert [rng.triple32_int(int(i)) for i in x] == rng.triple32(x).tolist()


def test_known_values_do_not_change():
    # Pinned so that a change of the hash (which would change every mask) is deliberate.
    assert rng.triple32_int(0) == 0
    assert rng.triple32_int(1) == 0x042741D6
    assert rng.dropout_key(0) != rng.dropout_key(1) and rng.dropout_key(0, 1) != rng.dropout_key(0, 2)


def test_keep_rate_and_threshold():
    idx = rng.logical_index((256, 256))
    for p in (0.0, 0.1, 0.5, 0.9):
        rate = rng.keep_mask(idx, rng.dropout_key(3), rng.keep_threshold(p)).float().mean().item()
        assert abs(rate - (1 - p)) < 0.01
    assert rng.keep_threshold(0.0) == 0
