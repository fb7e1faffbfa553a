"""Importing cocoweave, drawing its plots and running a compiled stage leave the user's process as it was:
matplotlib's backend (a notebook keeps its inline plots), Inductor's compile_threads (the user's own
torch.compile keeps its worker pool), and stderr (cocoweave's loggers print nothing unless asked)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

SCRIPT = textwrap.dedent("""
    import importlib, pkgutil, sys
    import matplotlib
    matplotlib.use("svg")  # the user's choice, not Agg
    import torch, torch._inductor.config as inductor
    inductor.compile_threads = 3  # the user's choice

    def state():
        return matplotlib.get_backend(), inductor.compile_threads

    before = state()
    import cocoweave
    for m in pkgutil.walk_packages(cocoweave.__path__, "cocoweave."):
        if not m.name.endswith("__main__"):  # `python -m cocoweave` runs the CLI
            importlib.import_module(m.name)
    after_import = state()

    import pandas as pd
    from cocoweave.perf.correction import AccuracyReport, scatter_png
    t = pd.DataFrame({"label": ["a", "b"], "measured_ms": [1.0, 2.0], "analytic_ms": [1.1, 1.8],
                      "corrected_ms": [1.0, 2.1]})
    scatter_png(AccuracyReport(6, 2, 10.0, 5.0, "gbr", t), __import__("pathlib").Path(sys.argv[1]), "t")
    after_plot = state()

    from cocoweave.backends.torch.runtime import CompiledStage
    seen = []
    def stage(x, y):
        seen.append(inductor.compile_threads)  # traced while compiling: the scoped value
        return x * y + 1.0
    out = CompiledStage(stage)(torch.ones(8), 2.0)
    assert torch.equal(out, torch.full((8,), 3.0)), out
    after_compile = state()
    print(before, after_import, after_plot, after_compile, seen)
    assert before == after_import == after_plot == after_compile == ("svg", 3), (after_import, after_plot,
                                                                                after_compile)
    assert seen and set(seen) == {1}, seen  # the stage itself compiled single-threaded
    import logging
    logging.getLogger("cocoweave.launch").warning("a record nobody asked to see")  # quiet by default
""")


def test_importing_plotting_and_compiling_leave_backend_and_compile_threads_alone(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MPLBACKEND", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "plot.png")], capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "a record nobody asked to see" not in proc.stderr  # cocoweave's loggers are quiet by default
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
