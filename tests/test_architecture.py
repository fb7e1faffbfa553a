"""The architecture's rules, checked on the source: no import cycle between files of cocoweave (imports under
`if TYPE_CHECKING:` aside), the torch backend never imports the reference backend, kernels/ imports nothing of
backends/, and the one-directional flow Program -> Schedule -> Plan -> Backend holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "cocoweave"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path) -> set[str]:
    """Modules of cocoweave that module `name` imports anywhere (functions included), TYPE_CHECKING aside."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("cocoweave"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("cocoweave"):
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
                out.update(subs if len(subs) == len(node.names) else subs + [target])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            strong(v)
    return found


def test_no_import_cycle_between_files():
    assert _cycles() == []


def _reaches(prefix: str, forbidden: str) -> list[str]:
    return sorted(f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith(prefix)
                  for t in ts if t.startswith(forbidden))


@pytest.mark.parametrize(("prefix", "forbidden"), [
    ("cocoweave.backends.torch", "cocoweave.backends.reference"),
    ("cocoweave.kernels", "cocoweave.backends"),
    ("cocoweave.ir", "cocoweave.schedule"),
    ("cocoweave.ir", "cocoweave.plan"),
    ("cocoweave.ir", "cocoweave.backends"),
    ("cocoweave.schedule", "cocoweave.plan"),
    ("cocoweave.schedule", "cocoweave.backends"),
    ("cocoweave.plan", "cocoweave.backends"),
])
def test_imports_flow_one_way(prefix: str, forbidden: str):
    assert _reaches(prefix, forbidden) == []


# ---------------------------------------------------------------------------------------------------------
# cluster/ by concern (issue #30, item 5)
# ---------------------------------------------------------------------------------------------------------

CLUSTER = SRC / "cluster"
CLUSTER_SHARED = {"__init__.py", "catalog.py", "schema.py", "yamlio.py"}  # what the three concerns share


def test_cluster_is_three_subpackages_by_concern_and_a_few_shared_modules():
    flat = {p.name for p in CLUSTER.glob("*.py")}
    assert flat == CLUSTER_SHARED, f"cluster/ files outside its subpackages: {sorted(flat - CLUSTER_SHARED)}"
    packages = {p.parent.relative_to(CLUSTER).as_posix() for p in CLUSTER.rglob("*.py") if p.parent != CLUSTER}
    assert packages == {"cmdare", "profiling", "planning", "planning/llm"}
    assert all((CLUSTER / p / "__init__.py").exists() for p in packages)  # setuptools' find ships packages only


def _gpu_tokens() -> set[str]:
    from cocoweave.cluster.catalog import load_catalog

    return {key.split("-")[0] for key in load_catalog().gpus}  # A100-80GB -> A100


def test_each_gpu_figure_is_written_once_in_the_catalog():
    """No Python file holds a GPU's figure: no {"K80": 240.5}-like table and no constant named after a GPU."""
    gpus = _gpu_tokens()
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                found += [f"{path.relative_to(SRC)}: {k.value!r}: {v.value!r}" for k, v in zip(node.keys, node.values)
                          if isinstance(k, ast.Constant) and isinstance(k.value, str)
                          and k.value.upper().split("-")[0] in gpus and isinstance(v, ast.Constant)
                          and isinstance(v.value, int | float)]
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, int | float):
                found += [f"{path.relative_to(SRC)}: {t.id}" for t in node.targets if isinstance(t, ast.Name)
                          and gpus & set(t.id.upper().split("_"))]
    assert not found, f"GPU figures outside cluster/data/catalog.yaml: {found}"


def test_the_cmdare_tables_read_gpu_bandwidth_from_the_catalog():
    from cocoweave.cluster.catalog import load_catalog
    from cocoweave.cluster.cmdare.tables import memory_bandwidth_gbs

    assert memory_bandwidth_gbs() == {k: g.hbm_gb_s for k, g in load_catalog().gpus.items()}


def test_the_resize_model_lives_with_the_planner_and_is_imported_at_the_top():
    model = {"predict_resizes", "progress_per_step", "parse_schedule"}
    defined = {n.name for n in ast.parse((SRC / "elastic.py").read_text()).body if isinstance(n, ast.FunctionDef)}
    assert not defined & model, "the resize cost model is back in elastic.py (its home: cluster/planning/resize.py)"
    late = []
    for path in CLUSTER.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                late += [f"{path.relative_to(SRC)}:{n.lineno}" for n in ast.walk(fn)
                         if isinstance(n, ast.ImportFrom) and n.module in ("cocoweave.elastic",
                                                                            "cocoweave.cluster.planning.resize")]
    assert not late, f"the resize model (or elastic) imported inside a function: {late}"
