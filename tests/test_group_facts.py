"""group_facts.shared_memory: the one answer to "do this group's collectives of these tensors go through this
host's shared memory" for the layers' programs, their posted all-reduces, the MoE all-to-alls and the optimizer's
buckets (a wrong yes would exchange through segments a CUDA tensor is not in; a wrong no loses the fast path)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocoweave import group_facts


@pytest.fixture
def two_ranks(monkeypatch):
    """A faked initialised world of two ranks whose shared-memory group is `SEGMENTS` (asked calls recorded)."""
    asked: list[object] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(group_facts.shm, "group_for", lambda group: asked.append(group) or "SEGMENTS")
    return asked


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_a_host_memory_tensor_of_a_one_host_group_goes_through_shared_memory(two_ranks, device):
    assert group_facts.shared_memory("g", device) == "SEGMENTS"
    assert two_ranks == ["g"]


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda", 1), "meta"])
def test_a_tensor_outside_the_hosts_memory_takes_the_library(two_ranks, device):
    assert group_facts.shared_memory("g", device) is None
    assert two_ranks == []  # decided without the group's collective


def test_one_rank_or_no_world_takes_the_library(two_ranks, monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert group_facts.shared_memory("g", "cpu") is None
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert group_facts.shared_memory(None, "cpu") is None
    assert two_ranks == []


def test_ranks_on_several_hosts_take_the_library(two_ranks, monkeypatch):
    monkeypatch.setattr(group_facts.shm, "group_for", lambda group: None)
    assert group_facts.shared_memory("g", "cpu") is None
