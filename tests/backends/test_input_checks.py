"""An executable checks its inputs once per input signature (names, shapes, dtypes, devices), not on every call:
bad input after good calls is still refused with the same sentence as on a first call."""

from __future__ import annotations

import pytest
import torch

from cocoweave.backends.torch.executable import Executable
from cocoweave.errors import InputError
from cocoweave.ir.loader import load_example
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules


def _inputs(n: int = 8, **change) -> dict:
    out = {"g": torch.ones(n), "w": torch.ones(n), "m": torch.zeros(n), "v": torch.zeros(n), "lr": 0.1,
           "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "step": 1.0}
    out.update(change)
    return out


def _exe() -> Executable:
    schedule = next(s for s in enumerate_schedules(load_example("adam.py:adam", N=8)) if s.name == "AR-C")
    return Executable(lower(schedule), 0, 1, {}, "cpu", kernels="torch")


@pytest.mark.parametrize("bad, sentence", [
    ({"g": torch.ones(9)}, r"rank 0: input `g` has shape \[9\], expected \[8\]"),
    ({"w": torch.ones(8, dtype=torch.float64)}, r"rank 0: input `w` is torch.float64, expected torch.float32"),
    ({"m": [0.0] * 8}, r"rank 0: input `m` must be a torch.Tensor, got list"),
    ({"lr": "fast"}, r"rank 0: scalar `lr` must be a number, got 'fast'"),
    ({"extra": torch.ones(8)}, r"rank 0: `extra` is not an input of program"),
])
def test_a_changed_input_after_good_calls_is_refused_with_the_first_calls_sentence(bad, sentence):
    fresh = _exe()
    with pytest.raises(InputError, match=sentence):
        fresh.run(_inputs(**bad))
    exe = _exe()
    exe.run(_inputs())
    exe.run(_inputs())  # the signature is known now: not checked again
    with pytest.raises(InputError, match=sentence):
        exe.run(_inputs(**bad))
    missing = _inputs()
    del missing["v"]
    with pytest.raises(InputError, match=r"rank 0: input `v` of program `.*` is missing"):
        exe.run(missing)
    exe.run(_inputs())  # and good input still runs


def test_a_repeated_signature_is_checked_once(monkeypatch):
    from cocoweave.backends.torch import executable

    calls = []
    check = executable.check_rank_inputs
    monkeypatch.setattr(executable, "check_rank_inputs", lambda *a, **k: calls.append(1) or check(*a, **k))
    exe = _exe()
    w = torch.ones(8)
    for _ in range(3):
        exe.run(_inputs(w=w))
    assert len(calls) == 1
    exe.run(_inputs(step=2))  # an int scalar where a float was: another signature, checked
    assert len(calls) == 2
