"""The torch backend's implementations of the collective algorithms, each algorithm's collectives one module that
registers them against the table (cocoweave.collectives): library.py, ring_algorithm.py, shm_algorithm.py.
Generated code calls each by its name (`ctx.ring_all_reduce(...)`: RankContext resolves registered names);
`method` is how the code generator finds that name."""

from __future__ import annotations

from ... import collectives
from . import library, ring_algorithm, shm_algorithm  # noqa: F401 - importing them registers their collectives

BACKEND = "torch"


def method(algorithm: str, op: str) -> str:
    """The name generated code calls `ctx.<name>(...)` by for `op` on `algorithm`: its registered implementation's
    (a function RankContext resolves by that name)."""
    return collectives.implementation(BACKEND, algorithm, op).__name__
