"""Kernel tests run the Triton kernels on CPU tensors in the interpreter, switched on before triton loads."""

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]

# The hand-written optimizer steps live beside the benchmarks that use them (benchmarks/baselines/), importable as
# `baselines` from there, as the benchmark scripts import them.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
