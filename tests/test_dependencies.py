"""Every third-party module that src/ imports (anywhere, functions included) is a dependency declared in
pyproject.toml, so that `pip install cocoweave` brings it; and the version has one source, the package's
metadata (pyproject.toml)."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

import cocoweave

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cocoweave"


def _top_level_imports() -> dict[str, str]:
    """{top-level module: a file importing it} for every absolute import in src/cocoweave."""
    out: dict[str, str] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                out.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return out


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = list(project["dependencies"]) + [r for extra in project.get("optional-dependencies", {}).values()
                                            for r in extra]
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_every_third_party_import_in_src_is_declared_in_pyproject():
    distributions = metadata.packages_distributions()
    declared = _declared()
    missing = {}
    for module, where in _top_level_imports().items():
        if module == "cocoweave" or module in sys.stdlib_module_names:
            continue
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not dists & declared:
            missing[module] = (sorted(dists), where)
    assert not missing, f"imported in src/ but not declared in pyproject.toml: {missing}"


def test_the_version_is_the_package_metadatas():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert cocoweave.__version__ == metadata.version("cocoweave") == pyproject
