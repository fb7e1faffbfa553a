"""Adam / AdamW kernels against torch.optim over a few steps, flat and multi-tensor, on odd sizes."""

import pytest
import torch
from baselines import adam_step, adam_step_multi

SHAPES = [(33, 17), (1,), (1000,), (0,), (7, 3, 5), (2048,)]
STEPS = 3


def views_of_one_buffer(shapes: list[tuple[int, ...]], start: int) -> list[torch.Tensor]:
    """Random tensors that are views into one buffer from element `start` (start=1: not 16-byte aligned)."""
    sizes = [torch.Size(s).numel() for s in shapes]
    buf = torch.randn(start + sum(sizes))
    return [t.view(s) for t, s in zip(buf[start:].split(sizes), shapes)]


@pytest.mark.parametrize("decoupled, weight_decay", [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_adam_flat(decoupled: bool, weight_decay: float) -> None:
    p = torch.randn(5003)
    ref = torch.nn.Parameter(p.clone())
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], lr=1e-2, betas=(0.8, 0.95),
                                                                   weight_decay=weight_decay)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, STEPS + 1):
        g = torch.randn_like(p)
        ref.grad = g.clone()
        opt.step()
        adam_step(p, g, m, v, lr=1e-2, step=step, beta1=0.8, beta2=0.95, weight_decay=weight_decay,
                  decoupled=decoupled, block=1024)
    state = opt.state[ref]
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("start", [0, 1])
def test_adam_multi(start: int) -> None:
    params = views_of_one_buffer(SHAPES, start)
    refs = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.1)
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for step in range(1, STEPS + 1):
        grads = [torch.randn_like(p) for p in params]
        for r, g in zip(refs, grads):
            r.grad = g.clone()
        opt.step()
        adam_step_multi(params, grads, ms, vs, lr=1e-2, step=step, weight_decay=0.1, decoupled=True,
                        block=256)
    for p, r, m in zip(params, refs, ms):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, opt.state[r]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_adam_rejects_mismatched_operands() -> None:
    p = torch.randn(10)
    with pytest.raises(ValueError, match="operands differ"):
        adam_step(p, torch.randn(11), torch.zeros(10), torch.zeros(10), lr=1e-3, step=1)
    with pytest.raises(ValueError, match="float32"):
        adam_step_multi([p], [torch.randn(10, dtype=torch.float64)], [p], [p], lr=1e-3, step=1)
