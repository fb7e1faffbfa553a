"""LAMB kernels against the written-out formula of You et al. 2020 (Algorithm 2) in float64."""

import pytest
import torch
from baselines import lamb_apply, lamb_norms, lamb_step, lamb_step_multi

OPTS = dict(beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01)
STEPS = 3


def lamb_reference(w, g, m, v, *, lr, step, beta1, beta2, eps, weight_decay, bias_correction=True):
    """One LAMB step in float64; returns (w, m, v, ||w||^2, ||u||^2)."""
    w, g, m, v = (t.double() for t in (w, g, m, v))
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = (m / (1 - beta1**step), v / (1 - beta2**step)) if bias_correction else (m, v)
    u = m_hat / (v_hat.sqrt() + eps) + weight_decay * w
    w_norm, u_norm = w.norm(), u.norm()
    ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    return w - lr * ratio * u, m, v, w_norm**2, u_norm**2


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_flat(bias_correction: bool) -> None:
    w = torch.randn(5003)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    rw, rm, rv = w.clone(), m.clone(), v.clone()
    for step in range(1, STEPS + 1):
        g = torch.randn_like(w)
        norms = lamb_step(w, g, m, v, lr=0.01, step=step, bias_correction=bias_correction, block=1024, **OPTS)
        rw, rm, rv, w_sq, u_sq = lamb_reference(rw, g, rm, rv, lr=0.01, step=step,
                                                bias_correction=bias_correction, **OPTS)
        close(norms, torch.stack([w_sq, u_sq]))
    close(w, rw)
    close(m, rm)
    close(v, rv)


def test_lamb_multi_per_tensor_ratios() -> None:
    shapes = [(33, 17), (1,), (1000,), (0, 4), (2048,)]
    params = [torch.randn(s) for s in shapes]
    params[1].zero_()  # ||w|| = 0: trust ratio 1
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    refs = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
    for step in range(1, STEPS + 1):
        grads = [torch.randn_like(p) for p in params]
        norms = lamb_step_multi(params, grads, ms, vs, lr=0.01, step=step, block=256, **OPTS)
        for i, ((rw, rm, rv), g) in enumerate(zip(refs, grads)):
            rw, rm, rv, w_sq, u_sq = lamb_reference(rw, g, rm, rv, lr=0.01, step=step, **OPTS)
            refs[i] = (rw, rm, rv)
            close(norms[i], torch.stack([w_sq, u_sq]))
    for p, m, (rw, rm, _) in zip(params, ms, refs):
        close(p, rw)
        close(m, rm)


def test_lamb_phases_on_slices_match_the_whole() -> None:
    """A sliced optimizer: phase 1 per slice, norms summed (the all-reduce), phase 2 per slice."""
    w, g = torch.randn(3000), torch.randn(3000)
    m, v = torch.randn(3000) * 0.1, torch.rand(3000) * 0.01
    whole = [t.clone() for t in (w, m, v)]
    lamb_step(whole[0], g, whole[1], whole[2], lr=0.01, step=4, **OPTS)
    slices = [t.tensor_split(3) for t in (w, g, m, v)]
    norms = sum(lamb_norms(*parts, step=4, **OPTS) for parts in zip(*slices))
    for ws, _, ms, vs in zip(*slices):
        lamb_apply(ws, ms, vs, norms, lr=0.01, step=4, **OPTS)
    torch.testing.assert_close(w, whole[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, whole[1], rtol=0, atol=0)


def test_eps_zero_keeps_the_masked_tail_out_of_the_norms() -> None:
    """With eps=0 the masked lanes of a tensor's last block compute 0 / 0; they must not reach ||u|| (it was NaN,
    and the trust ratio silently fell back to 1)."""
    opts = dict(OPTS, eps=0.0)
    w, g = torch.randn(4096 + 100), torch.randn(4096 + 100)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    expected = lamb_reference(w, g, m, v, lr=1e-3, step=1, **opts)
    norms = lamb_step(w, g, m, v, lr=1e-3, step=1, block=4096, **opts)
    assert torch.isfinite(norms).all(), norms
    close(norms, torch.stack(expected[3:]))
    close(w, expected[0])
    ws = [torch.randn(n) for n in (100, 4097)]
    gs = [torch.randn_like(t) for t in ws]
    norms = lamb_step_multi(ws, gs, [torch.zeros_like(t) for t in ws], [torch.zeros_like(t) for t in ws], lr=1e-3,
                            step=1, **opts)
    assert torch.isfinite(norms).all(), norms
