"""On a GPU only (skipped elsewhere; scripts/gpu_check.sh runs them): the kernels and a distributed optimizer step
on CUDA tensors, against torch on the same device. Inputs are fresh random numbers, never zeros."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a GPU and compiled Triton (TRITON_INTERPRET=0)")


def test_adamw_kernel_equals_torch_adamw_on_cuda() -> None:
    from baselines import adam_step

    torch.manual_seed(0)
    p = torch.randn(1 << 20, device="cuda")
    ref = torch.nn.Parameter(p.clone())
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
    for step in range(1, 4):
        g = torch.randn_like(p)
        ref.grad = g.clone()
        opt.step()
        adam_step(p, g, m, v, lr=1e-3, step=step, weight_decay=0.01, decoupled=True)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)


def test_lamb_with_eps_zero_has_finite_norms_on_cuda() -> None:
    from baselines import lamb_step

    w, g = torch.randn(4096 + 100, device="cuda"), torch.randn(4096 + 100, device="cuda")
    norms = lamb_step(w, g, torch.zeros_like(w), torch.zeros_like(w), lr=1e-3, step=1, eps=0.0)
    assert torch.isfinite(norms).all(), norms


def test_generated_kernels_equal_torch_ops_on_cuda() -> None:
    from cocoweave.backends.inputs import make_inputs
    from cocoweave.backends.torch.executable import Executable
    from cocoweave.ir.loader import load_example
    from cocoweave.plan import lower
    from cocoweave.schedule.enumerate import enumerate_schedules

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sizes = {"N": 100_003}
    program = load_example("adam.py:adam", **sizes)
    plan = lower(next(s for s in enumerate_schedules(program) if s.name == "AR-C"))
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_inputs(program, 1, sizes)[0].items()}
    triton_exe = Executable(plan, 0, 1, sizes, device="cuda", kernels="triton")
    assert triton_exe.kernel_sources()
    got = triton_exe.run({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}).outputs
    expected = Executable(plan, 0, 1, sizes, device="cuda", kernels="torch").run(dict(inputs)).outputs
    for name, e in expected.items():
        torch.testing.assert_close(got[name], e, rtol=1e-5, atol=1e-6, msg=name)
