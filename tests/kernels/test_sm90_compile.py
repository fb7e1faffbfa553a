"""Every kernel compiles for an H100 (sm_90) and its full blocks use 16-byte loads and stores, without spills.

Compiling needs no GPU; it runs `sm90_compile.py` in a subprocess without the interpreter.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
KERNELS = {"_adam_kernel", "_adam_multi_kernel", "_sgd_kernel", "_sgd_multi_kernel", "_norms_kernel",
           "_apply_kernel", "_norms_multi_kernel", "_reduce_kernel", "_apply_multi_kernel",
           "_bias_dropout_residual_kernel", "_random_bits_kernel"}


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="no CUDA backend")
def test_kernels_compile_for_sm90_with_wide_accesses() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(HERE / "sm90_compile.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    assert {r["kernel"] for r in reports} == KERNELS
    for r in reports:
        assert r["spills"] == 0 and r["stack"] == 0, r
        wide = sum(n for op, n in r["accesses"].items() if ".v4.b32" in op or ".v2.b64" in op)
        if r["kernel"] != "_reduce_kernel":  # reads [k, 2] partial sums: 8-byte accesses
            assert wide > 0, r
