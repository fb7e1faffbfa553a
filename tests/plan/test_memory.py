"""The Plan's memory decisions (plan/memory.py) as the executable uses them: an output handed to the caller with
`release` is never overwritten by the next step, whether it is a collective's buffer, a view of one, or a new
tensor; and a program whose outputs are all new tensors has no buffer for release to look at."""

from __future__ import annotations

import pytest
import torch

import cocoweave as cw
from cocoweave.backends.torch.executable import Executable
from cocoweave.ir.layout import Local
from cocoweave.ir.ops import all_reduce, cast
from cocoweave.plan import Memory, lower


def _program(*outputs: str) -> cw.Program:
    p = cw.Program("release_outputs")
    g = p.tensor("g", (4, 3), "float32", Local)
    r = all_reduce(g, "sum")
    made = {"whole": lambda: r,  # the collective's buffer itself
            "same": lambda: cast(r, "float32"),  # a cast to its own dtype: the buffer again, not a copy
            "fresh": lambda: r * 2.0}  # arithmetic: a new tensor
    for name in outputs:
        p.output(made[name](), name)
    return p


def test_outputs_that_may_be_buffers_are_the_ones_release_looks_at():
    plan = lower(_program("whole", "same", "fresh"))
    mem = Memory.of(plan, plan.view(0, 1, {}))
    assert mem.output_buffers == mem.output_views == (plan.outputs[0][1].name,)  # itself, and through the cast
    p = cw.Program("fresh_only")
    x = p.tensor("x", (4,), "float32")
    p.output(x * 3.0 + 1.0, "y")
    plan = lower(p)
    assert Memory.of(plan, plan.view(0, 1, {})).output_buffers == ()
    plan = lower(_program("whole", "fresh"))
    assert Memory.of(plan, plan.view(0, 1, {})).output_views == ()  # release needs no storage comparison


@pytest.mark.parametrize("outputs", [("whole",), ("same",), ("fresh",), ("whole", "same", "fresh")])
def test_a_released_output_survives_the_next_step(outputs: tuple[str, ...]):
    exe = Executable(lower(_program(*outputs)), 0, 1, kernels="torch")
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    first = exe.run({"g": a}).outputs
    kept = {n: exe.release(first[n]) for n in outputs}
    exe.run({"g": b})
    for n in outputs:
        assert torch.equal(kept[n], a * 2 if n == "fresh" else a), f"output `{n}` was overwritten by the next step"
