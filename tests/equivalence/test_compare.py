"""What `cocoweave check` calls equal: a schedule's result within its dtype's tolerance of the program as written.
For 16-bit floats an element of a sum of rounded terms is off by a rounding of the terms, not of the sum, so a
correct schedule that rounds a fused chain once (where the program as written rounds op by op) must pass where terms
cancel, and a wrong one must still fail."""

from __future__ import annotations

import pytest
import torch

from cocoweave import workloads
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.equivalence.check import check_schedules
from cocoweave.equivalence.compare import compare
from cocoweave.schedule.enumerate import enumerate_schedules


@pytest.mark.parametrize("make", [workloads.moe_dropless, workloads.moe_dropless_backward])
def test_every_bfloat16_schedule_of_the_dropless_experts_is_equal_at_width_64(make):
    """Failed before: the backward's fused elementwise schedules (max abs 2.0 where |expected| was ~0.2); with the
    fused stage compiled (Inductor) the forward's too (8.0) on Gloo ranks."""
    p = make(R=2, E=4, N=64, D=64, F=128, dtype="bfloat16")
    found = enumerate_schedules(p)
    for seed in (0, 1):
        bad = [(r.schedule, r.max_abs) for r in check_schedules(p, found, 2, seed=seed) if not r.ok]
        assert bad == []


def _expected(dtype: str, **swap: str) -> torch.Tensor:
    """Rank 0's y of moe_dropless in `dtype` on seed 3's inputs (`swap`: an input given another's value)."""
    p = workloads.moe_dropless(R=2, E=4, N=64, D=64, F=128, dtype=dtype)
    inputs = make_inputs(p, 2, {}, seed=3)
    for rank in inputs:
        for a, b in swap.items():
            rank[a] = rank[b]
    return reference.run(p, inputs, {})[0].outputs["y"]


def test_a_wrong_bfloat16_result_still_fails():
    y = _expected("bfloat16")
    assert compare(y.clone(), y).ok
    assert not compare(_expected("bfloat16", w1="w3"), y).ok  # w3 where w1 belongs
    shifted = y.clone()
    shifted[5] = y[6]  # one row from its neighbour (an offset off by one)
    assert not compare(shifted, y).ok
    small = y.abs().argmin()
    off = y.clone()
    off.view(-1)[small] += 0.2 * float(y.float().square().mean().sqrt())  # a fifth of the tensor's size
    assert not compare(off, y).ok


def test_float32_keeps_elementwise_tolerance():
    """Only 16-bit floats are compared at the tensor's size: a float32 error at an element near zero still fails."""
    y = _expected("float32")
    small = y.abs().argmin()
    off = y.clone()
    off.view(-1)[small] += 1e-2
    assert not compare(off, y).ok


def test_an_infinity_does_not_widen_a_16_bit_tolerance():
    """The tensor's size is its finite elements' root-mean-square: with an infinity in it every element passed."""
    want = torch.tensor([float("-inf"), 1.0, 2.0], dtype=torch.bfloat16)
    assert compare(want.clone(), want).ok
    assert not compare(torch.tensor([float("-inf"), 100.0, -50.0], dtype=torch.bfloat16), want).ok
