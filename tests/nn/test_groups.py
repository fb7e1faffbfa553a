"""Groups cocoweave makes carry the job's timeout (the default group's), not torch's 30 minutes for new groups, so a
rank that stops answering makes the others give up in about the time the job was started with."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cocoweave.nn import groups


@pytest.fixture
def world_of_one(monkeypatch):
    """A one-rank Gloo world in this process, started with a 7 s timeout (as init_from_env(timeout_s=7) does)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=7))
    monkeypatch.setattr(groups, "_CACHE", {})
    monkeypatch.setattr(groups, "_MESHES", {})
    yield
    dist.destroy_process_group()


def timeout_of(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_new_groups_and_mesh_groups_inherit_the_jobs_timeout(world_of_one):
    assert groups.job_timeout() == timedelta(seconds=7)
    assert timeout_of(groups.new_group([0])) == timedelta(seconds=7)  # torch's own default: 30 minutes
    made_by_torch = dist.new_group([0])  # what init_device_mesh makes for a dim that is not the whole world
    assert timeout_of(made_by_torch) == timedelta(minutes=30)
    assert timeout_of(groups.inherit_timeout(made_by_torch)) == timedelta(seconds=7)
    mesh = groups.parallel_mesh()
    assert {timeout_of(mesh.get_group(d)) for d in groups.MESH_DIMS} == {timedelta(seconds=7)}
