"""Plan agreement: ranks that would run different plans fail together, before any other collective, with a
sentence naming two ranks that differ; the world stays usable."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocoweave.backends.torch.agreement import agree
from cocoweave.errors import BackendError


def _agree(rank: int, world_size: int, odd_rank: int | None) -> str:
    value = agree("fp-odd" if rank == odd_rank else "fp-1234", "program fingerprint")
    t = torch.ones(1)
    dist.all_reduce(t)
    return value


def _sum(rank: int, world_size: int) -> float:
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    return t.item()


def test_agree_detects_a_mismatch_on_every_rank(world4):
    assert world4.run(_agree, None) == ["fp-1234"] * 4
    with pytest.raises(BackendError) as info:
        world4.run(_agree, 2)
    assert str(info.value) == ("ranks 0, 1, 2, 3 failed: BackendError: ranks disagree on program "
                       "fingerprint: rank 0 has 'fp-1234', rank 2 has 'fp-odd'")
    assert world4.broken is None  # every rank raised before any other collective: the world is consistent
    assert world4.run(_sum) == [10.0] * 4


def test_agree_outside_a_process_group_returns_the_value():
    if dist.is_initialized():
        pytest.skip("a process group of this process is open")
    assert agree("x", "anything") == "x"


def _agree_parts(rank: int, world_size: int) -> str:
    sizes = '{"N": 8}' if rank != 3 else '{"N": 9}'
    try:
        agree(f"fp {sizes}", "the plan", parts={"program": "adam", "schedule": "AR-C", "sizes": sizes})
    except BackendError as e:
        return str(e)
    return "agreed"


def test_a_disagreement_names_the_first_part_that_differs(world4):
    got = world4.run(_agree_parts)
    assert len(set(got)) == 1 and got[0].endswith(
        "they differ first in the sizes: rank 0 has '{\"N\": 8}', rank 3 has '{\"N\": 9}'")
