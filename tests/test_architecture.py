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


# -- memory decisions: one home in plan/memory.py (issue #30, item 2) ------------------------------------------

CODEGENS = ("cocoweave.backends.torch.codegen", "cocoweave.kernels.codegen", "cocoweave.backends.torch.executable")
DECIDES_MEMORY = ("in_place", "scratch", "gather_into", "gathers_into", "own_part", "alias")


def _functions(name: str) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8")))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


@pytest.mark.parametrize("name", CODEGENS)
def test_code_generators_and_the_executable_read_memory_decisions_from_the_plan(name: str):
    """Which value is computed over which temporary, which state an all-gather or a fused stage writes over, which
    buffers an output may be: decided once by plan/memory.py, never again by a code generator or the executable."""
    deciders = [f for f in _functions(name) if any(word in f for word in DECIDES_MEMORY)]
    assert deciders == [], f"{name} decides memory itself in {deciders}; ask plan.memory.Memory"
    imported = {a.name for n in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8")))
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("plan") for a in n.names}
    assert "Memory" in imported, f"{name} does not read the Plan's memory decisions (plan.memory.Memory)"


def _private_uses(receivers: tuple[str, ...], allowed_prefix: str, attrs: tuple[str, ...] = ()) -> list[str]:
    """`exe.kept` / `exe._x` style accesses (receiver named one of `receivers`) in modules outside `allowed_prefix`."""
    found = []
    for name, path in MODULES.items():
        if name.startswith(allowed_prefix):
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(n, ast.Attribute) or not (n.attr.startswith("_") or n.attr in attrs):
                continue
            recv = n.value.id if isinstance(n.value, ast.Name) else getattr(n.value, "attr", None)
            if recv in receivers and not n.attr.startswith("__"):
                found.append(f"{name}:{n.lineno} {recv}.{n.attr}")
    return found


def test_only_the_backend_touches_an_executables_kept_state_and_private_members():
    """Checkpoints and optimizers go through the Executable's public methods (state_part, adopt, gather_state)."""
    assert _private_uses(("exe", "executable"), "cocoweave.backends", ("kept",)) == []


def test_schedule_steps_use_no_private_member_of_a_schedule():
    """Steps map (program, stages) to new ones; the Schedule alone sets its own program and stages."""
    assert _private_uses(("schedule", "sched"), "cocoweave.schedule.schedule") == []
