"""How nn/compiled.py runs a layer program: its fused stages op by op on CPU unless a dropout stage needs the
compiled hash (or $COCOWEAVE_KERNELS chooses), and one resolution of its schedule per program, not per call."""

from __future__ import annotations

import pytest
import torch

from cocoweave.nn import programs as P
from cocoweave.nn.compiled import Programs, kernels

CPU = torch.device("cpu")


def test_stages_without_dropout_run_op_by_op_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COCOWEAVE_KERNELS", raising=False)
    assert kernels(P.column_backward(8, 4, 4), CPU) == "torch"
    assert kernels(P.row_backward(8, 4, 4, drop=0.0), CPU) == "torch"
    assert kernels(P.row_forward(8, 4, 4, drop=0.1), CPU) is None  # the hash stays compiled
    assert kernels(P.row_backward(8, 4, 4, drop=0.1), CPU) is None
    assert kernels(P.column_backward(8, 4, 4), torch.device("meta")) is None  # off the CPU: the default
    monkeypatch.setenv("COCOWEAVE_KERNELS", "compiled")  # the user's choice wins
    assert kernels(P.column_backward(8, 4, 4), CPU) is None


def test_a_program_resolves_its_schedule_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every later forward or backward of the same program goes to the executable the first one resolved."""
    import cocoweave.nn.compiled as C

    calls = []
    real = C.named
    monkeypatch.setattr(C, "named", lambda *a: calls.append(a[1]) or real(*a))
    progs = Programs("MM-AR-C", None, 1, 0)
    prog = P.row_forward(6, 4, 5, drop=0.0, bias=True, residual=False)
    x, w, b = torch.randn(6, 4), torch.randn(4, 5), torch.randn(5)
    outs = [progs.run("forward", prog, {"x": x, "w": w, "b": b}, CPU, ("out",))[0] for _ in range(3)]
    assert len(calls) == 1
    for out in outs:
        torch.testing.assert_close(out, x @ w + b)
    assert progs.chosen["forward"] == progs.describe().split(": ")[1]
