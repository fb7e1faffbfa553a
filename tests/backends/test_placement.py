"""Where collectives' metadata goes: NCCL alone takes no CPU tensor, so flags and norms go on the data's device
there, on the CPU where Gloo is beside it; cocoweave's NCCL worlds get Gloo beside them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocoweave.backends.torch import placement
from cocoweave.backends.torch.placement import backend_devices, group_backend, metadata_device


@pytest.mark.parametrize(("config", "devices"), [
    ("gloo", {"cpu", "cuda"}), ("nccl", {"cuda"}), ("cuda:nccl", {"cuda"}), ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ("cpu:gloo,cuda:gloo", {"cpu", "cuda"}), ("NCCL", {"cuda"}),
])
def test_backend_devices_reads_every_spelling_of_a_config(config, devices):
    assert backend_devices(config) == devices


@pytest.mark.parametrize(("config", "expected"), [
    ("cuda:nccl", "meta"), ("cpu:gloo,cuda:nccl", "cpu"), ("cpu:gloo,cuda:gloo", "cpu"),
])
def test_metadata_goes_on_the_cpu_only_where_the_group_takes_cpu_tensors(monkeypatch, config, expected):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert metadata_device(None, torch.device("meta")).type == expected


def test_metadata_outside_a_world_is_on_the_cpu():
    if dist.is_initialized():
        pytest.skip("a process group is live in this process")
    assert metadata_device(None, "meta") == placement.CPU


def test_nccl_worlds_get_gloo_beside_them_for_cpu_tensors():
    assert group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert group_backend("gloo") == "gloo"
    assert backend_devices(group_backend("nccl")) == {"cpu", "cuda"}
