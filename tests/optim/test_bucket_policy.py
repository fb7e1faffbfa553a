"""The bucket policy (the one place bucket sizes are decided): parameters in backward order, by dtype (and size for
LAMB's rows), up to the cap unless one parameter alone is larger; Adasum's one tensor per bucket; flat sizes padded
to the world size."""

from __future__ import annotations

import torch

from cocoweave.optim.bucket_policy import BucketPolicy, flat_size


def _params(*specs: tuple[int, torch.dtype]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in specs]


def test_buckets_fill_in_backward_order_up_to_the_cap_one_dtype_each():
    a, b, c, h, d = _params((10, torch.float32), (20, torch.float32), (30, torch.float32), (10, torch.bfloat16),
                            (100, torch.float32))
    parts = BucketPolicy(cap_bytes=200, pad_to=2).partition([a, b, h, c, d])
    assert [[(p.numel(), p.dtype) for p in ps] for ps in parts] == [  # d alone is over the cap
        [(100, torch.float32)], [(30, torch.float32), (20, torch.float32)], [(10, torch.bfloat16)],
        [(10, torch.float32)]]


def test_adasum_combines_each_tensor_alone_and_frozen_parameters_get_no_bucket():
    ps = _params((4, torch.float32), (4, torch.float32), (4, torch.float32))
    ps[1].requires_grad_(False)
    policy = BucketPolicy.of(25.0, "adasum", rows=False, world_size=2)
    assert [len(part) for part in policy.partition(ps)] == [1, 1]
    assert BucketPolicy.of(25.0, "avg", rows=False, world_size=2).cap_bytes == 25 * 2**20  # DDP's default


def test_row_buckets_hold_parameters_of_one_size():
    ps = _params((8, torch.float32), (4, torch.float32), (8, torch.float32))
    parts = BucketPolicy(cap_bytes=2**20, rows=True).partition(ps)
    assert sorted(sorted(p.numel() for p in part) for part in parts) == [[4], [8, 8]]


def test_flat_sizes_are_the_next_multiple_of_the_world_size():
    assert [flat_size(15, w) for w in (1, 2, 3, 4, 8)] == [15, 16, 15, 16, 16]
