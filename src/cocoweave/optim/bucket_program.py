"""What the optimizer uses of a bucket's compiled program (the torch backend's Executable): its one interface to
the backend. cocoweave.optim touches nothing else of an executable (tests/test_architecture.py checks it), so the
backend may change how it runs a plan (its buffers, what it keeps) without the optimizer noticing."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any, Protocol

import torch


class BucketProgram(Protocol):
    """A compiled optimizer program of one bucket, as the optimizer drives it."""

    @property
    def sliced_state(self) -> list[str]:
        """The state it keeps sliced between calls."""

    def tensor_inputs(self) -> dict[str, torch.dtype]:
        """Its tensor inputs (runtime scalars aside) and their dtypes."""

    def shared_input(self, name: str) -> torch.Tensor | None:
        """Where to put input `name` so that its collectives need no copies (None: anywhere)."""

    def adopt(self, name: str, t: torch.Tensor) -> None:
        """Take state `name` (kept sliced) from now on."""

    def local_shape(self, name: str) -> tuple[int, ...]:
        """This rank's part of input `name`."""

    def gather_state(self, name: str) -> torch.Tensor:
        """State `name` whole (a collective when it is kept sliced)."""

    def launch(self, inputs: Mapping[str, Any]) -> bool:
        """Issue the step's first collective now (from a backward hook); False when it opens with none."""

    def steps(self, inputs: Mapping[str, Any], defer_gathers: bool = False) -> Generator[tuple[int, dict], None, Any]:
        """One step, paused before each stage: yields (stage index, the tensors it reads)."""

    def stage_op(self, index: int) -> str:
        """The collective stage `index` runs, "" for a computation."""

    def stage_names(self, index: int) -> tuple[str, ...]:
        """The values stage `index` computes."""

    def provide(self, value: str, result: torch.Tensor) -> None:
        """Give the result of collective `value` for the paused step (one global norm over many buckets)."""

    def wait(self) -> None:
        """Complete the all-gathers a step left in flight."""

    def cancel(self) -> None:
        """Drop a collective launched for a step that will not run."""
