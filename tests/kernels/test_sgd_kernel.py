"""SGD kernels against torch.optim.SGD over a few steps, flat and multi-tensor, on odd sizes."""

import pytest
import torch
from baselines import sgd_step, sgd_step_multi

CASES = [  # momentum, dampening, nesterov, weight_decay
    (0.0, 0.0, False, 0.0),
    (0.0, 0.0, False, 0.01),
    (0.9, 0.0, False, 0.0),
    (0.9, 0.2, False, 0.01),
    (0.9, 0.0, True, 0.01),
]
STEPS = 3


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("momentum, dampening, nesterov, weight_decay", CASES)
def test_sgd(multi: bool, momentum: float, dampening: float, nesterov: bool, weight_decay: float) -> None:
    shapes = [(3001,), (17, 5), (1,)] if multi else [(3001,)]
    params = [torch.randn(s) for s in shapes]
    refs = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.SGD(refs, lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov,
                          weight_decay=weight_decay)
    bufs = [torch.empty_like(p) for p in params] if momentum else None
    opts = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    for step in range(STEPS):
        grads = [torch.randn_like(p) for p in params]
        for r, g in zip(refs, grads):
            r.grad = g.clone()
        opt.step()
        if multi:
            sgd_step_multi(params, grads, bufs, first_step=step == 0, block=512, **opts)
        else:
            sgd_step(params[0], grads[0], bufs and bufs[0], first_step=step == 0, block=512, **opts)
    for i, (p, r) in enumerate(zip(params, refs)):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
        if momentum:
            torch.testing.assert_close(bufs[i], opt.state[r]["momentum_buffer"], rtol=1e-5, atol=1e-6)


def test_sgd_checks_arguments() -> None:
    p = torch.randn(4)
    with pytest.raises(ValueError, match="Nesterov"):
        sgd_step(p, p, torch.zeros(4), lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="buffers"):
        sgd_step(p, p, None, lr=0.1, momentum=0.9)
