"""Compile every kernel the wrappers launch for sm_90 (an H100) without a GPU, and count its memory accesses.

The interpreter runs kernels as Python and misses what only the compiler checks (global names, types), and
says nothing of access widths. Run with TRITON_INTERPRET=0: `python tests/kernels/sm90_compile.py` records
the wrappers' launches on CPU tensors instead of running them, compiles each launch's specialisation to
PTX and prints one JSON line per kernel: the global loads/stores by width, FMA and approximate instructions, and
ptxas's spill/stack report. Generated kernels: one per distinct set of operations over every schedule of the
optimizers' programs and the parallel examples (`--every-generated`: one per distinct body, ~135, for a full
check; scripts/gpu_check.sh runs it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import Any

import torch
import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64", torch.bool: "i1",
          torch.int32: "i32"}


def record_launches(calls) -> list[tuple[JITFunction, dict[str, Any]]]:
    """Run `calls()` with JITFunction.run replaced by a recorder; return (kernel, arguments) per launch."""
    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, dict(zip(self.arg_names, args)) | kwargs))

    from cocoweave.kernels import multi_tensor

    original, JITFunction.run = JITFunction.run, run
    checked, multi_tensor.interpreted = multi_tensor.interpreted, lambda: True  # CPU tensors stand in for GPU ones
    try:
        calls()
    finally:
        JITFunction.run, multi_tensor.interpreted = original, checked
    return launches


def compile_sm90(fn: JITFunction, args: dict[str, Any]) -> dict[str, Any]:
    """Compile one launch as the launcher would specialise it (16-byte divisibility of pointers and ints)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = "*" + DTYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            signature[param.name], aligned = "fp32", False
        elif value == 1 and not param.do_not_specialize:  # the launcher makes ints equal to 1 constants
            signature[param.name], constexprs[param.name] = "constexpr", 1
            continue
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0 and not param.do_not_specialize
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": args.get("num_warps", 4),
                                     "enable_fp_fusion": args.get("enable_fp_fusion", True)})
    ptx = kernel.asm["ptx"]
    accesses = Counter(re.findall(r"\b((?:ld|st)\.global(?:\.v\d)?\.b\d+)", ptx))
    return {"kernel": fn.__name__, "accesses": dict(accesses), "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
            "approx": sorted(set(re.findall(r"\b(?:ex2|lg2|rsqrt|sqrt|div)\.approx[.\w]*", ptx))),
            **ptxas_report(ptx)}


def ptxas_report(ptx: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from `ptxas -v`."""
    bin_dir = os.path.join(os.path.dirname(nvidia.__file__), "bin")
    # Triton 3.9 assembles sm_90 with its newer ptxas ("ptxas-blackwell"); 3.6 has only "ptxas"
    ptxas = next(p for n in ("ptxas-blackwell", "ptxas") if os.path.exists(p := os.path.join(bin_dir, n)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    found = {k: int(m.group(1)) for k, pat in [("registers", r"Used (\d+) registers"),
                                              ("stack", r"(\d+) bytes stack frame"),
                                              ("spills", r"(\d+) bytes spill stores")]
             if (m := re.search(pat, log))}
    return found


def wrapper_calls() -> None:
    """Every wrapper once per kernel variant that matters, on CPU tensors (launches are only recorded)."""
    from baselines import adam_step, adam_step_multi, lamb_step, lamb_step_multi, sgd_step, sgd_step_multi

    from cocoweave.kernels import bias_dropout_residual, random_bits

    n = 1 << 20
    p, g, m, v = (torch.empty(n) for _ in range(4))
    ps = [torch.empty(s) for s in (4096, 1000, 3 * 4096)]
    lists = [ps, *([torch.empty_like(t) for t in ps] for _ in range(3))]
    adam_step(p, g, m, v, lr=1e-3, step=1, weight_decay=0.1, decoupled=True)
    adam_step_multi(*lists, lr=1e-3, step=1, weight_decay=0.1, decoupled=True)
    sgd_step(p, g, m, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)
    sgd_step_multi(*lists[:3], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)
    lamb_step(p, g, m, v, lr=1e-3, step=1, weight_decay=0.01)
    lamb_step_multi(*lists, lr=1e-3, step=1, weight_decay=0.01)
    x = torch.empty(64, 3072, dtype=torch.bfloat16)
    bias_dropout_residual(x, torch.empty(3072, dtype=torch.bfloat16), x, 0.1, seed=0, dim=-1, offset=3072,
                          full_size=4 * 3072)  # a slice along the last dim: one row per group
    random_bits(torch.empty(n, dtype=torch.int64), seed=0)


def generated_programs() -> list[tuple[str, Any, dict[str, int]]]:
    """(label, program, sizes) of what the torch backend generates kernels for: the optimizers' programs in every
    variant cocoweave.optim builds (dtype, master weights, clipping, masking) and the parallel examples."""
    import itertools

    from cocoweave.ir.loader import load_example
    from cocoweave.workloads import optimizers as W

    out = []
    for name in ("sgd", "adam", "adamw"):
        for dtype, master, clip, masked in itertools.product(("float32", "bfloat16"), (False, True), (False, True),
                                                             (False, True)):
            if not (master and dtype == "float32"):
                program = getattr(W, name)(N=1000, param_dtype=dtype, master_weights=master, clip=clip, masked=masked)
                out.append((f"{name}-{dtype}-m{master:d}c{clip:d}k{masked:d}", program, {"N": 1000}))
    for masked in (False, True):
        out.append((f"lamb-rows-k{masked:d}", W.lamb(N=1000, T=4, rows=True, masked=masked), {"N": 1000, "T": 4}))
    import cocoweave as cw

    math = cw.Program("math")  # the operations whose precise forms codegen picks (exp, pow, rsqrt)
    a = math.tensor("a", (1000,), "float32")
    math.output(cw.exp(-cw.abs(a)) + (cw.abs(a) + 0.5) ** math.scalar("s") + (cw.abs(a) + 1) ** -0.5
                + cw.rsqrt(cw.abs(a) + 2), "y")
    out.append(("math", math, {}))
    for spec, sizes in [("model_parallel.py:layer", {"B": 4, "S": 8, "H": 64}),
                        ("pipeline_parallel.py:boundary", {"B": 4, "S": 8, "H": 64}), ("tp2d.py:mlp", {}),
                        ("tp3d.py:mlp", {})]:
        out.append((spec, load_example(spec, **sizes), sizes))
    return out


def _form(source: str, every: bool) -> Any:
    """What makes two generated kernels compile alike: every one of their distinct bodies (numbers aside), or for
    the sample the set of operations, casts and operators they use."""
    body = re.sub(r"#[^\n]*", "", source.split('"""', 2)[2])
    if every:
        return re.sub(r"\d+", "N", body)
    return frozenset(re.findall(r"tl\.\w+|precise_\w+|keep_mask|\.to\(tl\.\w+\)|== 0\)|[-+*/%<>]=?|\bif\b", body))


def generated_specs(every: bool = False) -> list[tuple[str, Any]]:
    """(label, KernelSpec) of one generated kernel per distinct form (`_form`) over every schedule of
    `generated_programs` on 1, 2 and 3 ranks (rank 0 and the last)."""
    from cocoweave.errors import ProgramError
    from cocoweave.kernels.codegen import NoKernel, kernel_spec
    from cocoweave.plan import lower
    from cocoweave.schedule.enumerate import enumerate_schedules

    forms: dict[Any, tuple[str, Any]] = {}
    for label, program, sizes in generated_programs():
        for schedule in enumerate_schedules(program):
            plan = lower(schedule)
            for world, rank in ((1, 0), (2, 0), (3, 0), (3, 2)):
                for index in range(len(plan.stages)):
                    try:
                        spec = kernel_spec(plan, index, rank, world, sizes)
                    except (NoKernel, ProgramError):  # no kernel there, or a world the program cannot use
                        continue
                    forms.setdefault(_form(spec.source, every),
                                     (f"{label} {schedule.name} stage {index} rank {rank}/{world}", spec))
    return list(forms.values())


def generated_calls(specs: list[tuple[str, Any]]) -> None:
    """Launch each spec's kernel once on CPU tensors of its inputs' sizes (launches are only recorded)."""
    from cocoweave.ir.types import DTYPES
    from cocoweave.kernels.codegen import FusedKernel

    for label, spec in specs:
        kernel = FusedKernel(spec, torch.device("cpu"), "sm90-" + re.sub(r"\W", "-", label))
        kernel(*(torch.empty(n, dtype=DTYPES[v.dtype]) if kind == "tensor" else 0.5 if kind == "float" else 3
                 for v, kind, n in zip(spec.inputs, spec.kinds, spec.numels)))


if __name__ == "__main__":
    import sys

    every = "--every-generated" in sys.argv
    specs = generated_specs(every)
    labels = iter([label for label, _ in specs])
    for fn, args in record_launches(wrapper_calls):
        print(json.dumps(compile_sm90(fn, args)))
    for fn, args in record_launches(lambda: generated_calls(specs)):
        print(json.dumps({**compile_sm90(fn, args), "generated": next(labels)}))
