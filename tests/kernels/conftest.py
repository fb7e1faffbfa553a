"""Kernel tests run the Triton kernels on CPU tensors in the interpreter, switched on before triton loads."""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
