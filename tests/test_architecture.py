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


# -- collective algorithms: one table (cocoweave.collectives), issue #30 --------------------------------------------
def _ctx_calls(path: Path) -> list[tuple[int, str]]:
    """(line, expression) of every name an f-string of `path` formats straight after `ctx.`: a runtime method name
    computed by the code generator."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr):
            for before, part in zip(node.values, node.values[1:]):
                if isinstance(before, ast.Constant) and str(before.value).endswith("ctx.") and \
                        isinstance(part, ast.FormattedValue):
                    found.append((node.lineno, ast.unparse(part.value)))
    return found


def test_codegen_builds_no_runtime_method_name_from_strings():
    """The torch code generator names a runtime method only as the implementation registered for (algorithm,
    operation) (backends/torch/algorithms.py `method`), never by gluing an algorithm's name to an operation's."""
    import re

    calls = _ctx_calls(SRC / "backends" / "torch" / "codegen.py")
    assert calls, "the code generator calls the runtime's collectives"
    registered = r"(em|self)\.method\(\w+\)|runtime_method\([\w., ]+\)"  # backends/torch/algorithms.py's method
    built = [(line, e) for line, e in calls if not re.fullmatch(registered, e)]
    assert built == []
    text = (SRC / "backends" / "torch" / "codegen.py").read_text(encoding="utf-8")
    assert "runtime_method(" in text and "prefix()" not in text


def _ratio_of_one_less(path: Path) -> list[int]:
    """Lines of `path` whose code divides something built from `(x - 1)` by `x`: a bytes-moved factor like
    2 * (p - 1) / p."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Name):
            x = node.right.id
            for sub in ast.walk(node.left):
                if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub) and isinstance(sub.left, ast.Name) \
                        and sub.left.id == x and isinstance(sub.right, ast.Constant) and sub.right.value == 1:
                    lines.append(node.lineno)
    return lines


def test_the_bytes_moved_formula_exists_once():
    """What a collective moves is written in collectives/traffic.py alone; the cost model, calibration and the
    cluster's step scaling read it."""
    where = {str(p.relative_to(SRC)): lines for p in SRC.rglob("*.py") if (lines := _ratio_of_one_less(p))}
    assert list(where) == ["collectives/traffic.py"], where


def test_collective_algorithms_sit_below_everything_that_reads_them():
    assert [t for m, ts in GRAPH.items() if m.startswith("cocoweave.collectives") for t in ts
            if not t.startswith(("cocoweave.collectives", "cocoweave.errors"))] == []
    readers = ("cocoweave.schedule.stages", "cocoweave.schedule.enumerate", "cocoweave.backends.torch.codegen",
               "cocoweave.perf.costmodel", "cocoweave.perf.calibrate", "cocoweave.cluster", "cocoweave.optim")
    reading = {m for m, ts in GRAPH.items() if any(t.startswith("cocoweave.collectives") for t in ts)}
    assert [r for r in readers if not any(m.startswith(r) for m in reading)] == []
