"""sigmoid, silu and silu_grad, SwiGLU's activation and its derivative as DSL operations: the reference's meaning is
torch's (silu_grad: what autograd computes through F.silu), and the torch backend's generated code (op by op, fused,
and on host scalars) computes the same bits, at every magnitude, where exp(-x) overflows included (silu(-100) is -0,
not nan; sigmoid(-1000) is 0, not an OverflowError)."""

from __future__ import annotations

import math

import pytest
import torch

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.torch.executable import Executable
from cocoweave.equivalence.compare import compare
from cocoweave.plan import lower
from cocoweave.schedule.schedule import Schedule

TORCH = {"sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu, "silu_grad": torch.ops.aten.silu_backward}


def _operands(op: str, x: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands `_program` gives op: x, or (d * 1.5, x) for silu_grad."""
    return (d * 1.5, x) if op == "silu_grad" else (x,)
# exp(-x) overflows float32 below -88.73 and float64 below -709.8; halves are computed in float32
EXTREMES = [-1e4, -1000.0, -100.0, -88.8, -88.7, -20.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 20.0, 88.7, 100.0,
            1e4, math.inf]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (torch.equal takes -0.0 for 0.0)."""
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype, torch.int16))


def _values(dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.tensor(EXTREMES), torch.randn(500, generator=gen) * 30, torch.randn(500, generator=gen)])
    return x.to(getattr(torch, dtype))


def _program(op: str, dtype: str, n: int, fused: bool) -> Schedule:
    """y = op(x) (silu_grad(d * 1.5, x): computed over that temporary) and z = y * x + 1 (a chain for a fused
    stage) on one rank."""
    p = cw.Program(op)
    x, d = p.tensor("x", (n,), dtype, cw.Local), p.tensor("d", (n,), dtype, cw.Local)
    y = cw.silu_grad(d * 1.5, x) if op == "silu_grad" else getattr(cw, op)(x)
    p.output(y, "y")
    p.output(y * x + 1.0, "z")
    s = Schedule(p)
    if fused:
        s.fuse(s.stages[0])
    return s


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", sorted(TORCH))
def test_the_reference_and_the_torch_backend_compute_torchs_bits(op, dtype):
    x, d = _values(dtype), _values(dtype).flip(0)
    want = TORCH[op](*_operands(op, x, d))
    if dtype != "float32":  # halves: torch's op computes in float32 too, rounding once
        assert torch.equal(_bits(TORCH[op](*(t.float() for t in _operands(op, x, d))).to(x.dtype)), _bits(want))
    for fused in (False, True):
        plan = lower(_program(op, dtype, x.numel(), fused))
        ref = reference.run(plan, [{"x": x, "d": d}])[0].outputs
        assert torch.equal(_bits(ref["y"]), _bits(want)), (op, dtype, fused)
        exe = Executable(plan, 0, 1, {}, kernels="torch")
        if op == "silu_grad" and dtype == "float32":  # over the temporary d * 1.5 (float32 and float64 only)
            assert "rt.silu_grad(" in exe.source and ", out=" in exe.source
        got = exe.run({"x": x.clone(), "d": d.clone()}).outputs
        assert torch.equal(_bits(got["y"]), _bits(want)), (op, dtype, fused)
        assert torch.equal(_bits(got["z"]), _bits(ref["z"])), (op, dtype, fused)


@pytest.mark.parametrize("op", sorted(TORCH))
def test_a_fused_stage_compiled_equals_the_reference(op):
    """The CPU default route: the fused stage as one loop compiled by torch.compile, within compare's tolerance of
    the reference (Inductor's exp is not torch's), the overflowing end exact (-0 and 0, no nan)."""
    x, d = _values("float32"), _values("float32").flip(0)
    plan = lower(_program(op, "float32", x.numel(), True))
    ref = reference.run(plan, [{"x": x, "d": d}])[0].outputs
    got = Executable(plan, 0, 1, {}, kernels="compiled").run({"x": x.clone(), "d": d.clone()}).outputs
    for name in ("y", "z"):
        assert compare(got[name], ref[name]).ok, (name, compare(got[name], ref[name]))
    assert torch.equal(_bits(got["y"][:4]), _bits(ref["y"][:4]))  # -1e4 .. -88.8


@pytest.mark.parametrize("op", sorted(TORCH))
def test_exp_overflow_gives_the_limit_not_nan(op):
    x = torch.tensor([-1e4, -100.0, 100.0, 1e4])
    y = reference.run(lower(_program(op, "float32", 4, False)), [{"x": x, "d": torch.full((4,), 2.0)}])[0]
    y = y.outputs["y"]
    assert not y.isnan().any()
    want = {"silu": [-0.0, -0.0, 100.0, 1e4], "sigmoid": [0.0, 0.0, 1.0, 1.0], "silu_grad": [-0.0, -0.0, 3.0, 3.0]}
    assert torch.equal(_bits(y), _bits(torch.tensor(want[op])))  # silu: -100 / (1 + inf), a negative zero


def test_silu_grad_is_what_autograd_computes_through_silu():
    x, d = _values("float32").requires_grad_(), _values("float32").flip(0)
    (grad,) = torch.autograd.grad(torch.nn.functional.silu(x), x, d * 1.5)
    plan = lower(_program("silu_grad", "float32", x.numel(), False))
    ref = reference.run(plan, [{"x": x.detach(), "d": d}])[0].outputs["y"]
    assert torch.equal(_bits(ref), _bits(grad))


HOST = [-1e4, -745.2, -100.0, -1.5, -0.0, 0.0, 3.0, 800.0, *torch.randn(24, generator=torch.Generator().manual_seed(3),
                                                                        dtype=torch.float64).mul(8).tolist()]


def test_host_scalars_equal_the_reference():
    """A scalar's sigmoid, silu and silu_grad are Python floats on the host: the reference's float64 values, bit for
    bit, where math.exp would raise OverflowError (exp(1e4)) too."""
    p = cw.Program("host")
    x = p.tensor("x", (3,), "float64", cw.Local)
    ts = p.scalars(" ".join(f"t{i}" for i in range(len(HOST))))
    for i, t in enumerate(ts):
        p.output(x * cw.sigmoid(t), f"a{i}")
        p.output(x * cw.silu(t), f"b{i}")
        p.output(x * cw.silu_grad(t * 0.5 + 1.0, t), f"c{i}")
    plan = lower(Schedule(p))
    inputs = {"x": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64),
              **{f"t{i}": torch.tensor(s, dtype=torch.float64) for i, s in enumerate(HOST)}}
    ref = reference.run(plan, [inputs])[0].outputs
    exe = Executable(plan, 0, 1, {}, kernels="torch")
    assert "float(torch.sigmoid(" in exe.source and "float(rt.silu_grad(" in exe.source  # computed on the host
    got = exe.run(dict(inputs)).outputs
    for i, s in enumerate(HOST):
        t64 = torch.tensor(s, dtype=torch.float64)
        for name, fn in (("a", torch.sigmoid), ("b", torch.nn.functional.silu),
                         ("c", lambda t: torch.ops.aten.silu_backward(t * 0.5 + 1.0, t))):
            name = f"{name}{i}"
            assert torch.equal(_bits(got[name]), _bits(ref[name])), (name, s, got[name], ref[name])
            assert torch.equal(_bits(ref[name]), _bits(inputs["x"] * fn(t64))), (name, s)
