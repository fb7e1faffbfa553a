"""What a backend returns for one rank of a run: its outputs and its updated state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RankResult:
    """What one rank holds after a run: its outputs and its updated state tensors."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
