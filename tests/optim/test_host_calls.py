"""Host work per step that does not grow with the parameter count (issue #45): DistributedAdamW's zero_grad makes
no Python call per parameter, its backward adds only the two autograd hooks per parameter (the view handed to
autograd before accumulation, the arrival after it), and its step one pointer comparison per parameter (a user's
replaced weights are taken back). Counted with cProfile, as benchmarks/host_overhead.py counts them; torch's own
DDP + AdamW(fused) makes about 11 calls per parameter in its step."""

from __future__ import annotations

import cProfile

import pytest
import torch
from torch import nn

from cocoweave.optim import DistributedAdamW


def _calls(fn) -> int:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return sum(e.callcount for e in prof.getstats())


def _per_phase(blocks: int) -> dict[str, int]:
    """Python calls of each phase of a warm step of `blocks` Linear(4, 4) layers (2 x blocks parameters), and of
    the same forward and backward with no optimizer (the model's own calls)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(4, 4), nn.Tanh())])
    x = torch.randn(2, 4)
    plain = _calls(lambda: model(x).square().mean().backward())
    opt = DistributedAdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    out: dict[str, int] = {}
    for _ in range(3):  # the fewest of three steps: a step may also pay for a recompile of its fused stages
        counted = {"zero_grad": _calls(opt.zero_grad),
                   "backward": _calls(lambda: model(x).square().mean().backward()),
                   "step": _calls(opt.step)}
        out = {k: min(v, out.get(k, v)) for k, v in counted.items()}
    out["model"] = plain
    return out


PARAMS = 2 * (250 - 25)  # the parameters the larger model has more
SLACK = 20  # calls that do not depend on the parameters but differ between two models (their generated programs)


def _growth(rank: int, world_size: int) -> dict[str, int]:
    """How many more calls each phase makes for PARAMS more parameters."""
    small, large = _per_phase(25), _per_phase(250)
    return {k: large[k] - small[k] for k in small}


@pytest.mark.parametrize("world_size", [1, 2])
def test_calls_per_step_do_not_grow_with_parameters_beyond_the_hooks(local_world, world_size: int) -> None:
    for g in local_world(world_size).run(_growth):
        assert g["zero_grad"] <= SLACK, g
        assert g["backward"] - g["model"] <= 2 * PARAMS + SLACK, g  # the two autograd hooks, nothing inside them
        if world_size == 1:  # at 2 ranks the step also polls shared memory for the other rank: a count of waiting
            assert g["step"] <= PARAMS + SLACK, g  # restore_views' one data_ptr per parameter
