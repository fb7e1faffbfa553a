"""cluster/ stands beside the compiler: none of its files imports ir, schedule, plan or backends (nor perf,
apart from the measurement store); the profiler's in-rank recorder alone wraps the shared-memory collectives."""

from __future__ import annotations

import ast
from pathlib import Path

import cocoweave.cluster

FORBIDDEN = ("cocoweave.ir", "cocoweave.schedule", "cocoweave.plan", "cocoweave.backends", "cocoweave.kernels",
             "cocoweave.tune", "cocoweave.perf")
ALLOWED = ("cocoweave.perf.store",)
# The in-rank recorder instruments what it measures: it wraps the shared-memory collectives as it wraps torch's.
ALLOWED_IN = {"recorder.py": ("cocoweave.backends.torch", "cocoweave.backends.torch.shm")}


def imported_modules(path: Path, package: str = "cocoweave.cluster") -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved against `package`, the file's own)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def package_of(path: Path, folder: Path) -> str:
    """The package a file of cluster/ belongs to: cocoweave.cluster, or one of its subpackages."""
    return ".".join(("cocoweave", "cluster", *path.parent.relative_to(folder).parts))


def test_no_cluster_file_imports_the_compiler():
    folder = Path(cocoweave.cluster.__file__).parent
    files = sorted(folder.rglob("*.py"))
    assert len(files) > 5
    bad = {f"{path.name}: {name}" for path in files for name in imported_modules(path, package_of(path, folder))
           if name.startswith(FORBIDDEN) and not name.startswith(ALLOWED) and name not in ALLOWED_IN.get(path.name, ())}
    assert not bad, f"cluster/ imports the compiler: {sorted(bad)}"


def test_relative_imports_are_resolved(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..plan import lower\nfrom .planner import plan_cluster\n")
    assert {"cocoweave.plan", "cocoweave.cluster.planner"} <= imported_modules(probe)
    probe.write_text("from ...backends.torch import shm\nfrom ..catalog import load_catalog\n")
    assert {"cocoweave.backends.torch.shm", "cocoweave.cluster.catalog"} <= imported_modules(
        probe, "cocoweave.cluster.profiling")
