"""Shared fixtures of the whole test suite. Keep each part in its own section."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

# Fused stages run op by op in the suite unless a test asks for a route (kernels="compiled" / "triton"): compiling
# every schedule of every example at every world size would take most of the suite's time. The compiled route (the
# CPU default for users) has its own equivalence tests: tests/backends/test_compiled_route.py.
os.environ.setdefault("COCOWEAVE_KERNELS", "torch")

# The tuning cache (where schedule="auto" also keeps its measured choices) is the session's own: no test reads a
# developer's cache or a previous run's choices.
os.environ.setdefault("COCOWEAVE_TUNE_CACHE", os.path.join(tempfile.mkdtemp(prefix="cocoweave-tests-"),
                                                           "tune-cache.json"))

# ---------------------------------------------------------------------------------------------------------
# Local worlds of live rank processes (cocoweave.launch), shared by every test of the session.
# Tests that break a world (kill a rank, hang, time out) must make their own LocalWorld instead.
# ---------------------------------------------------------------------------------------------------------

if TYPE_CHECKING:
    from cocoweave.launch import LocalWorld



@pytest.fixture(scope="session")
def local_world(time_scale: float) -> Iterator[Callable[[int], LocalWorld]]:
    """`local_world(n)`: LocalWorld of n CPU ranks (started when first used, restarted if broken), whose ranks wait
    for each other 60 s times the machine's slowness (a first compile of a fused stage can take that long)."""
    from cocoweave.launch import LocalWorld  # noqa: F811 - imported here so collection stays light

    worlds: dict[int, LocalWorld] = {}

    def get(world_size: int) -> LocalWorld:
        world = worlds.get(world_size)
        if world is None:
            world = worlds[world_size] = LocalWorld(world_size, timeout_s=60.0 * time_scale)
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


# ---------------------------------------------------------------------------------------------------------
# Time bounds of reliability tests (a hang named within the timeout, a dead rank named quickly) were set on a quiet
# 2-core machine; on a loaded or throttled one every step takes longer. `time_scale` stretches them by how much
# slower this machine runs a fixed piece of Python than that one did (at least 1; COCOWEAVE_TEST_TIME_SCALE sets it).
# A hang still fails: the bounds grow by a measured factor, not to infinity.
# ---------------------------------------------------------------------------------------------------------

_QUIET_LOOP_S = 0.013  # the loop below on the quiet 2-core KVM guest the bounds were set on
_MOST_SCALE = 20.0  # beyond this a bound would stop bounding anything: the test then fails and says why


def _measure_time_scale() -> float:
    """Mean time of a fixed loop over ten runs against the quiet machine's (stalls of a throttled VM count: they are
    what stretches a timed call)."""
    import time

    given = os.environ.get("COCOWEAVE_TEST_TIME_SCALE")
    if given:
        return max(1.0, float(given))
    t0 = time.perf_counter()
    for _ in range(10):
        total = 0
        for i in range(200_000):
            total += i
    return min(_MOST_SCALE, max(1.0, (time.perf_counter() - t0) / (10 * _QUIET_LOOP_S)))


@pytest.fixture(scope="session")
def time_scale() -> float:
    """How many times slower than the quiet reference machine this one runs now (>= 1)."""
    return _measure_time_scale()


@pytest.fixture(scope="session")
def whole_time_scale(time_scale: float) -> int:
    """`time_scale` as a whole factor (>= 1), for timeouts given in whole seconds."""
    return max(1, round(time_scale))
