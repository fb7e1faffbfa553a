"""Shared fixtures of the whole test suite. Keep each part in its own section."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

# Fused stages run op by op in the suite unless a test asks for a route (kernels="compiled" / "triton"): compiling
# every schedule of every example at every world size would take most of the suite's time. The compiled route (the
# CPU default for users) has its own equivalence tests: tests/backends/test_compiled_route.py.
os.environ.setdefault("COCOWEAVE_KERNELS", "torch")

# ---------------------------------------------------------------------------------------------------------
# Local worlds of live rank processes (cocoweave.launch), shared by every test of the session.
# Tests that break a world (kill a rank, hang, time out) must make their own LocalWorld instead.
# ---------------------------------------------------------------------------------------------------------

if TYPE_CHECKING:
    from cocoweave.launch import LocalWorld



@pytest.fixture(scope="session")
def local_world() -> Iterator[Callable[[int], LocalWorld]]:
    """`local_world(n)`: LocalWorld of n CPU ranks (started when first used, restarted if broken)."""
    from cocoweave.launch import LocalWorld  # noqa: F811 - imported here so collection stays light

    worlds: dict[int, LocalWorld] = {}

    def get(world_size: int) -> LocalWorld:
        world = worlds.get(world_size)
        if world is None:
            world = worlds[world_size] = LocalWorld(world_size)
        elif world.broken:
            world.restart()
        return world

    yield get
    for world in worlds.values():
        world.close()


@pytest.fixture(scope="session")
def world4(local_world: Callable[[int], LocalWorld]) -> LocalWorld:
    """The session's LocalWorld of 4 CPU ranks."""
    return local_world(4)
