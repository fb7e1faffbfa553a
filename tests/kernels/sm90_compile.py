"""Compile every kernel the wrappers launch for sm_90 (an H100) without a GPU, and count its memory accesses.

The interpreter runs kernels as Python and misses what only the compiler checks (global names, types), and
says nothing of access widths. Run with TRITON_INTERPRET=0: `python tests/kernels/sm90_compile.py` records
the wrappers' launches on CPU tensors instead of running them, compiles each launch's specialisation to
PTX and prints one JSON line per kernel: the global loads/stores by width and ptxas's spill/stack report.
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

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32"}


def record_launches(calls) -> list[tuple[JITFunction, dict[str, Any]]]:
    """Run `calls()` with JITFunction.run replaced by a recorder; return (kernel, arguments) per launch."""
    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, dict(zip(self.arg_names, args)) | kwargs))

    original, JITFunction.run = JITFunction.run, run
    try:
        calls()
    finally:
        JITFunction.run = original
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
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": args.get("num_warps", 4)})
    ptx = kernel.asm["ptx"]
    accesses = Counter(re.findall(r"\b((?:ld|st)\.global(?:\.v\d)?\.b\d+)", ptx))
    return {"kernel": fn.__name__, "accesses": dict(accesses), **ptxas_report(ptx)}


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
    from cocoweave.kernels import (
        adam_step,
        adam_step_multi,
        bias_dropout_residual,
        lamb_step,
        lamb_step_multi,
        random_bits,
        sgd_step,
        sgd_step_multi,
    )

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


if __name__ == "__main__":
    for fn, args in record_launches(wrapper_calls):
        print(json.dumps(compile_sm90(fn, args)))
