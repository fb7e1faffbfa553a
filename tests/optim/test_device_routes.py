"""What the optimizers decide for a CUDA run, checked without a GPU: metadata of their collectives on a device the
group takes (NCCL: the bucket's, or the CPU through a Gloo group beside it), new weights in place when step()
returns unless deferring is asked for, and buckets padded to a multiple of the world size with a zero tail."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cocoweave import group_facts
from cocoweave.backends.torch import placement
from cocoweave.optim import DistributedAdamW, base
from cocoweave.optim.buckets import Bucket, make_buckets


class _Reduced(Exception):
    """Raised by the fake all-reduce once it has seen the tensor."""


@pytest.fixture
def nccl_world(monkeypatch):
    """Two ranks on an NCCL-only group (faked): every all-reduce records its tensor's device and stops."""
    seen: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(base, "world", lambda group=None: (0, 2))
    monkeypatch.setattr(group_facts.shm, "group_for", lambda group: None)  # several hosts: no shared memory

    def all_reduce(t, op=None, group=None):
        seen.append(t.device)
        raise _Reduced

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


def _optimizer_on(device: str) -> SimpleNamespace:
    bucket = SimpleNamespace(device=torch.device(device))
    return SimpleNamespace(process_group=None, _set_to_none=True, _buckets=[bucket], _flag_slots=None)


def test_used_parameter_flags_go_through_a_cpu_group_beside_nccl(nccl_world, monkeypatch):
    """Over a group that takes no CPU tensor the flags go on the CPU through a Gloo group beside it (made once):
    reading them back syncs no GPU."""
    side, made, used = object(), [], []
    monkeypatch.setattr(placement, "_CPU_SIDE", {})
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, **kw: made.append((ranks, backend)) or side)

    def all_reduce(t, op=None, group=None):
        used.append((t.device.type, group))
        raise _Reduced

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    for _ in range(2):
        with pytest.raises(_Reduced):
            DistributedAdamW._agree(_optimizer_on("meta"), [1, 0, 1])
    assert used == [("cpu", side)] * 2 and made == [([0, 1], "gloo")]


def test_clipping_without_partials_reduces_a_zero_on_the_buckets_device(nccl_world):
    with pytest.raises(_Reduced):
        DistributedAdamW._clip(_optimizer_on("meta"), [])
    assert [d.type for d in nccl_world] == ["meta"]


def test_new_weights_are_in_place_when_step_returns_on_cuda_unless_forward_is_asked_for():
    cuda_bucket = SimpleNamespace(device=torch.device("cuda"))
    for gather, deferred in [("auto", False), ("step", False), ("forward", True)]:
        assert DistributedAdamW._defer(SimpleNamespace(gather=gather), cuda_bucket) is deferred


def test_buckets_are_padded_to_the_world_size_with_a_zero_tail():
    params = [torch.nn.Parameter(torch.randn(s)) for s in (5, 3, 7)]
    for size in (1, 2, 3, 4, 8):
        (b,) = make_buckets(0, params, 2**20, pad_to=size)
        assert b.numel % size == 0 and b.numel - 15 < size
    b = Bucket(0, params, pad_to=4)
    poisoned = torch.full(b.shape, float("nan"))
    b.attach(data=poisoned)
    assert b.shape == (16,) and b.data[15] == 0 and torch.equal(b.grad, torch.zeros(16))
    assert all(torch.equal(p.data, b.part(b.data, i)) for i, p in enumerate(params))
