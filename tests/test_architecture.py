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


# -- the environment is read in two homes (issue #30): rankenv (the rank's place) and settings (COCOWEAVE_*) ---------

ENV_HOMES = {"cocoweave.rankenv", "cocoweave.settings"}
# Every other use of os.environ, with its reason; keyed by file name (not its folder, so that a move keeps its entry)
# and variable ("*": the whole environment).
ENV_EXCEPTIONS = {
    ("network", "GLOO_SOCKET_IFNAME"): "Gloo's own variable: read, and set for this process when a world meets on "
                                      "a loopback address",
    ("precise", "TRITON_INTERPRET"): "Triton's own switch (its interpreter), asked of Triton before 3.3",
    ("executable", "TRITON_INTERPRET"): "Triton's own switch: kernels on the CPU run only under its interpreter",
    ("codecache", "XDG_CACHE_HOME"): "the XDG rule for the code cache's default folder",
    ("worlds", "*"): "copies the whole environment for the torchrun it starts (and adds the profiler's settings)",
}


def _environ_uses(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of each use of os.environ or os.getenv in a file: "*" where the whole environment is used,
    "?" where the variable is not a literal."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                {a.name for a in node.names} & {"environ", "getenv", "environb"}:
            uses.append((node.lineno, "?"))
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "getenv", "environb")):
            continue
        up, key = parent.get(node), None
        if isinstance(up, ast.Subscript):
            key = up.slice
        elif isinstance(up, ast.Compare) and up.comparators and up.comparators[0] is node:
            key = up.left
        elif isinstance(up, ast.Attribute) and isinstance(parent.get(up), ast.Call) and parent[up].args:
            key = parent[up].args[0]  # os.environ.get(KEY), .pop(KEY), .setdefault(KEY)
        elif isinstance(up, ast.Call) and node.attr == "getenv" and up.args:
            key = up.args[0]
        name = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else "?" if key else "*"
        uses.append((node.lineno, name))
    return uses


def test_the_environment_is_read_only_by_rankenv_and_settings():
    stray = sorted(f"{name}:{line} uses os.environ[{var!r}]" for name, path in MODULES.items() if name not in ENV_HOMES
                   for line, var in _environ_uses(path) if (path.stem, var) not in ENV_EXCEPTIONS)
    assert stray == [], "read COCOWEAVE_* through cocoweave.settings and rank variables through cocoweave.rankenv"
    from cocoweave.rankenv import LAUNCHERS
    from cocoweave.settings import SETTINGS

    launcher_vars = {v for launcher in LAUNCHERS for v in vars(launcher).values() if v}
    assert not {var for _, var in ENV_EXCEPTIONS} & (launcher_vars | {s.name for s in SETTINGS})


def test_cores_are_counted_in_one_place():
    assert sorted(name for name, path in MODULES.items()
                  if "sched_getaffinity" in path.read_text(encoding="utf-8")) == ["cocoweave.rankenv"]


# -- the optimizer (issue #30, item 3) ------------------------------------------------------------------------------
OPTIM = sorted((SRC / "optim").glob("*.py"))
CONTRACT_NAMES = {"g", "w", "p", "t", "active", "started", "max_norm", "m", "v", "buf",  # the programs' tensors
                  "exp_avg", "exp_avg_sq", "momentum_buffer"}  # torch's state-dict keys of the moments


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string literals of a module, its docstrings and f-strings' format specs (`:g`) aside."""
    skip = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    skip |= {id(c) for n in ast.walk(tree) if isinstance(n, ast.FormattedValue) and n.format_spec is not None
             for c in ast.walk(n.format_spec)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_the_optimizers_contract_with_its_programs_is_written_once():
    """The names of the optimizer programs' inputs and state live in workloads/optimizer_contract.py alone: optim/
    spells none of them, and the programs declare none by a literal name."""
    spelt = [f"{p.name}:{n.lineno} {n.value!r}" for p in OPTIM for n in _strings(ast.parse(p.read_text()))
             if n.value in CONTRACT_NAMES]
    assert spelt == []
    programs = SRC / "workloads" / "optimizers.py"
    declared = [f"{programs.name}:{n.lineno}" for n in ast.walk(ast.parse(programs.read_text()))
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("tensor", "state", "scalar", "scalars", "output")
                and any(isinstance(a, ast.Constant) and isinstance(a.value, str)  # the name: first (output: second)
                        for a in n.args[1 if n.func.attr == "output" else 0:][:1])]
    assert declared == []


def test_the_optimizer_reaches_its_executables_only_through_their_one_interface():
    """optim/ uses of a bucket's executable only the members BucketProgram declares, all public, and Executable has
    every one of them."""
    from cocoweave.backends.torch.executable import Executable
    from cocoweave.optim.bucket_program import BucketProgram

    interface = {n for n in vars(BucketProgram) if not n.startswith("_")}
    assert interface and all(hasattr(Executable, n) for n in interface)
    used = set()
    for p in OPTIM:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and (isinstance(n.value, ast.Name) and n.value.id == "exe" or
                                                 isinstance(n.value, ast.Attribute) and n.value.attr == "exe"):
                used.add(n.attr)
    assert used and used <= interface


def test_no_optimizer_file_holds_more_than_one_job():
    """optim/'s files stay small (one job each, ~350 lines at most); the torch face (base.py) smaller still."""
    lines = {p.name: len(p.read_text().splitlines()) for p in OPTIM}
    assert max(lines.values()) <= 350 and lines["base.py"] <= 200, lines


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
    model = {"predict_resizes", "progress_per_step", "parse_resize_plan", "parse_schedule"}
    defined = {n.name for p in (SRC / "elastic").glob("*.py") for n in ast.parse(p.read_text()).body
               if isinstance(n, ast.FunctionDef)}
    assert not defined & model, "the resize cost model is back in elastic/ (its home: cluster/planning/resize.py)"
    late = []
    for path in CLUSTER.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                late += [f"{path.relative_to(SRC)}:{n.lineno}" for n in ast.walk(fn)
                         if isinstance(n, ast.ImportFrom) and n.module in ("cocoweave.elastic",
                                                                            "cocoweave.cluster.planning.resize")]
    assert not late, f"the resize model (or elastic) imported inside a function: {late}"


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


# ---------------------------------------------------------------------------------------------------------
# the package root by concern (issue #49, item 4)
# ---------------------------------------------------------------------------------------------------------

# What may sit at the package root: what every layer shares, each with its reason. Everything else lives in the
# subpackage of its concern (launch/, checkpoint/, elastic/, storage/, equivalence/, ...).
ROOT_MODULES = {
    "__init__.py": "the names users import from cocoweave",
    "__main__.py": "`python -m cocoweave`, the command line",
    "compiler.py": "`cw.compile`, the front door from a program to something that runs",
    "errors.py": "the exception classes every layer raises",
    "faults.py": "fault injection and stage tracking, hooked into the backend, checkpoints, launchers and the CLI",
    "group_facts.py": "a process group's facts and per-step small collectives for nn and optim: with the "
                      "executables, their one way to a backend (issue #49)",
    "figures.py": "matplotlib figures, drawn by the planner, the profiler, perf and the demo",
    "jsonable.py": "the one JSON encoding of everything cocoweave writes",
    "log.py": "cocoweave's logging",
    "rankenv.py": "the rank's environment, read in one place (with settings: the two homes of os.environ)",
    "rng.py": "the counter-based random numbers of dropout, identical in every backend",
    "settings.py": "every COCOWEAVE_* variable, declared once",
    "settings_doc.py": "docs/settings.md from the settings table (`python -m cocoweave.settings_doc`)",
    "sharding.py": "tensor-parallel parameters as DTensors, shared by nn, optim, checkpoint, elastic and preflight",
    "version.py": "the installed version",
}
ROOT_MAX_LINES = 400


def test_the_package_root_holds_only_what_every_layer_shares():
    loose = {p.name for p in SRC.glob("*.py")}
    assert loose <= set(ROOT_MODULES), f"root modules outside the shared list: {sorted(loose - set(ROOT_MODULES))}"
    assert all((p / "__init__.py").exists() for p in SRC.iterdir() if p.is_dir() and any(p.glob("*.py")))


def test_no_package_root_module_is_over_400_lines():
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in SRC.glob("*.py")}
    assert {name: n for name, n in lines.items() if n > ROOT_MAX_LINES} == {}


# -- one pricing model of links and collectives (issue #49, item 1) ------------------------------------------------

LINK_FIGURES = {"bandwidth", "latency", "bandwidth_gb_s", "latency_us"}  # a link's (catalog's, Link's) figures
PRICING = "collectives/pricing.py"


def _link_arithmetic(path: Path) -> list[int]:
    """Lines of `path` computing with a link's bandwidth or latency (an operand named or attributed so)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.BinOp):
            sides = (node.left, node.right)
            if LINK_FIGURES & {s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", None) for s in sides}:
                lines.append(node.lineno)
    return lines


def _calls_of(path: Path, attr: str) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


def test_collectives_are_priced_by_one_model():
    """Only collectives/pricing.py turns a link's bandwidth and latency into seconds, from the algorithms' registered
    traffic and steps; the tuner's cost model, the profiler's hardware model and the LLM planner price through it
    (no formula, ring-or-tree choice or host_scaling wrapper of their own); `modellable` and the missing-GPU
    error are written once (cluster/catalog.py)."""
    where = {str(p.relative_to(SRC)): lines for p in SRC.rglob("*.py") if (lines := _link_arithmetic(p))}
    assert list(where) == [PRICING], where
    outside = [p for p in SRC.rglob("*.py") if p.parent.name != "collectives"]
    assert {str(p.relative_to(SRC)): c for p in outside if (c := _calls_of(p, "traffic"))} == {}
    assert [m for m, ts in GRAPH.items() if "cocoweave.collectives.traffic" in ts
            and not m.startswith("cocoweave.collectives")] == []
    for reader in ("cocoweave.perf.costmodel", "cocoweave.cluster.profiling.hardware_model",
                   "cocoweave.cluster.planning.llm.comm"):
        assert "cocoweave.collectives.pricing" in GRAPH[reader], reader
    assert not [t for t in GRAPH["cocoweave.cluster.planning.llm.comm"] if t.startswith("cocoweave.cluster.profiling")]
    defs = [f"{p.relative_to(SRC)}" for p in SRC.rglob("*.py") for n in ast.walk(ast.parse(p.read_text("utf-8")))
            if isinstance(n, ast.FunctionDef) and n.name == "modellable"]
    assert defs == ["cluster/catalog.py"], defs
    sentences = [f"{p.relative_to(SRC)}" for p in SRC.rglob("*.py")
                 if "has no spec-sheet entry" in p.read_text(encoding="utf-8")]
    assert sentences == ["cluster/catalog.py"], sentences


# -- collective kinds: each one registration (cocoweave.collectives.kinds), issue #49 items 4-5 --------------------
REWRITE_KINDS = ("all_reduce", "reduce_scatter", "all_gather")  # the schedule algebra's own: split, reorder, fuse
KIND_HOMES = ("collectives/", "ir/ops.py")  # the table of kinds, and the built-in kinds' registrations


def _tested_strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants a module branches on or tabulates by: the operands of comparisons (`op == "x"`,
    `op in ("x", "y")`), the keys of dict literals and `case` values."""
    found: list[ast.AST] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            found += [n.left, *n.comparators]
        elif isinstance(n, ast.Dict):
            found += [k for k in n.keys if k is not None]
        elif isinstance(n, ast.MatchValue):
            found.append(n.value)
    return [c for f in found for c in ast.walk(f) if isinstance(c, ast.Constant) and isinstance(c.value, str)]


def _kind_spellings(src: Path = SRC) -> list[str]:
    """(file:line string) of every branch or table outside the kinds' homes on a kind the schedule algebra does not
    single out ("all_to_all"), or on a kind's library benchmark ("all_reduce/library")."""
    from cocoweave import collectives

    names = {k.name for k in collectives.all_kinds()}
    named = names - set(REWRITE_KINDS)
    benchmarks = {f"{k}/{collectives.DEFAULT}" for k in names}
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = str(path.relative_to(src))
        if rel.startswith(KIND_HOMES):
            continue
        for c in _tested_strings(ast.parse(path.read_text(encoding="utf-8"))):
            if c.value in named or c.value in benchmarks:
                found.append(f"{rel}:{c.lineno} {c.value!r}")
    return found


def test_a_collective_kinds_facts_are_spelt_only_in_its_registration():
    """Its token, meaning, runtime call, traffic, benchmark and recorded functions sit in its CollectiveKind; the
    reference backend, the code generator, schedules, calibration and the recorder read them from there (no
    `if op == "all_to_all"` and no table keyed by kinds elsewhere)."""
    assert "all_to_all" in {k.name for k in __import__("cocoweave").collectives.all_kinds()}
    assert _kind_spellings() == []


def test_a_rank_context_keeps_resources_and_each_algorithm_its_collectives():
    """RankContext (backends/torch/runtime.py) defines none of the collectives registered for the torch backend:
    each algorithm's are functions of a context in their own module (library.py, ring_algorithm.py,
    shm_algorithm.py)."""
    from cocoweave import collectives
    from cocoweave.backends.torch import algorithms  # noqa: F401 - registers the torch backend's collectives

    tree = ast.parse((SRC / "backends" / "torch" / "runtime.py").read_text("utf-8"))
    context = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RankContext")
    defined = {n.name for n in ast.walk(context) if isinstance(n, ast.FunctionDef)}
    registered = set(collectives.implementations("torch"))
    assert {"all_reduce", "ring_all_reduce", "shm_all_gather", "fused_ring", "send_recv"} <= registered
    assert defined & registered == set()
    assert len((SRC / "backends" / "torch" / "runtime.py").read_text("utf-8").splitlines()) <= 420


# ---------------------------------------------------------------------------------------------------------
# A new optimizer is one file (issue #49: a factored-state optimizer, tests/optim/test_change_requests.py)
# ---------------------------------------------------------------------------------------------------------


def test_optim_names_no_optimizer_family_outside_optimizers_py():
    """Only optim/optimizers.py (and __init__.py, which re-exports it) names an optimizer family: a program of
    workloads/optimizers.py, a Distributed* class, a family's state or scalar list of the contract. The machinery
    reaches a family only through DistributedOptimizer's hooks (workload, state_keys, scalars, state_shape,
    state_part, shaped, ...), so an optimizer it does not know (an Adafactor in a test) needs no edit of it."""
    import inspect

    from cocoweave.optim import optimizers as classes
    from cocoweave.workloads import optimizer_contract as contract
    from cocoweave.workloads import optimizers as programs

    family = {n for n, v in vars(programs).items() if inspect.isfunction(v) and v.__module__ == programs.__name__
              and not n.startswith("_")}
    family |= {n for n, v in vars(classes).items() if inspect.isclass(v) and v.__module__ == classes.__name__}
    family |= {n for n in vars(contract) if n.endswith(("_STATE", "_SCALARS"))}
    assert {"adamw", "sgd", "lamb", "DistributedAdamW", "ADAM_STATE", "SGD_SCALARS"} <= family, family
    named = []
    for path in OPTIM:
        if path.name in ("optimizers.py", "__init__.py"):
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            ids = [n.id] if isinstance(n, ast.Name) else [n.attr] if isinstance(n, ast.Attribute) else \
                [a.name for a in n.names] + [n.module or ""] if isinstance(n, ast.ImportFrom) else []
            named += [f"{path.name}:{n.lineno} {i}" for i in ids if i in family or i.endswith("workloads.optimizers")]
    assert named == [], named


# -- layers speak to one interface, and one "auto" (issue #49, items 2 and 3) -------------------------------------

def _every_import(name: str, path: Path) -> set[str]:
    """Every module a file imports, wherever the import stands (functions and `if TYPE_CHECKING:` included), resolved
    to its full dotted name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out.update({target} | {f"{target}.{a.name}" for a in node.names})
    return out


@pytest.mark.parametrize("layer", ["cocoweave.nn", "cocoweave.optim"])
def test_layers_and_optimizers_import_no_backend_module(layer: str):
    """nn/ and optim/ reach a backend only through cocoweave.group_facts (a process group's facts and transport) and
    the executables the compiler makes: no import of a module of backends/, at any depth, anywhere in a file."""
    found = sorted(f"{m} imports {t}" for m, p in MODULES.items() if m == layer or m.startswith(layer + ".")
                   for t in _every_import(m, p) if t == "cocoweave.backends" or t.startswith("cocoweave.backends."))
    assert found == []
    assert not any(m.startswith("cocoweave.backends") for m in GRAPH if "cocoweave.group_facts" in GRAPH[m])


def test_a_process_groups_facts_have_one_home():
    """Rank, size, the shared-memory route, timeout: defined in cocoweave.group_facts alone, not again in nn/ or
    optim/."""
    facts = {"world", "group_rank", "group_size", "shared_memory", "group_timeout"}
    defined = sorted(f"{m}.{n.name}" for m, p in MODULES.items() if m.startswith(("cocoweave.nn", "cocoweave.optim"))
                     for n in ast.parse(p.read_text(encoding="utf-8")).body
                     if isinstance(n, ast.FunctionDef) and n.name in facts)
    assert defined == []


# The one answer to schedule="auto", and what may read the tuning cache besides it.
ANSWERS = {"choose", "auto_schedule"}  # tune.choose, and the compiler's face of it (checked to call choose)
CACHE_NAMES = {"TuneCache", "cached_schedule", "cache_key", "_recall", "_remember"}
CACHE_READERS = {"cocoweave.cli.tune_commands": "the `cocoweave tune` command: checks the cache it will write is "
                                                "readable, and writes the tuner's choice"}
AUTO_KNOBS = {"backend", "device", "kernels"}  # other settings spelt "auto": a launcher's backend, a device, kernels


def _names(tree: ast.AST) -> set[str]:
    """Every name a module uses: plain names, attributes, imported names."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.ImportFrom | ast.Import):
            out.update(a.name.rpartition(".")[2] for a in n.names)
    return out


def test_only_tune_reads_the_tuning_caches_choices():
    readers = sorted(m for m, p in MODULES.items() if not m.startswith("cocoweave.tune") and m not in CACHE_READERS
                     and _names(ast.parse(p.read_text(encoding="utf-8"))) & CACHE_NAMES)
    assert readers == [], "ask tune.choose(program, context, fallback) instead of the tuning cache"


def test_no_module_but_tune_keeps_a_memo_of_choices():
    """A process-wide memory of "auto"'s answers lives in tune (choose's `Context.keep`): no module-level table of
    choices, and no memoised chooser, anywhere else."""
    chooser = ("chose", "choice", "choos", "auto", "resolve")
    kept = []
    for m, p in MODULES.items():
        if m.startswith("cocoweave.tune"):
            continue
        for n in ast.parse(p.read_text(encoding="utf-8")).body:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            kept += [f"{m}.{t.id}" for t in targets if isinstance(t, ast.Name)
                     and any(w in t.id.lower() for w in chooser)
                     and isinstance(n.value, ast.Dict | ast.Set | ast.List | ast.Call)]
        for f in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(f, ast.FunctionDef) and any(w in f.name.lower() for w in chooser):
                kept += [f"{m}.{f.name}" for d in f.decorator_list
                         if "cache" in ast.unparse(d) or "lru" in ast.unparse(d)]
    assert kept == []


def _compares_auto(fn: ast.AST) -> list[int]:
    """Lines where `fn` tests a value that is not a knob of AUTO_KNOBS against "auto"."""
    def is_auto(e: ast.AST) -> bool:
        return (isinstance(e, ast.Constant) and e.value == "auto") or (
            isinstance(e, ast.Tuple | ast.List | ast.Set) and any(is_auto(x) for x in e.elts))

    lines = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            others = [s for s in sides if not is_auto(s)]
            if len(others) < len(sides) and not all(ast.unparse(s).rpartition(".")[2] in AUTO_KNOBS for s in others):
                lines.append(n.lineno)
    return lines


def _reaches_an_answer(tree: ast.AST, fn: ast.AST) -> bool:
    """Whether `fn` calls one of ANSWERS, directly or through functions of its own module (by name)."""
    defs: dict[str, list[ast.AST]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            defs.setdefault(n.name, []).append(n)

    def calls(f: ast.AST) -> set[str]:
        return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(f)
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name | ast.Attribute)}

    seen, todo = set(), [fn]
    while todo:
        called = calls(todo.pop())
        if called & ANSWERS:
            return True
        for name in called - seen:
            seen.add(name)
            todo += defs.get(name, [])
    return False


# Modules that predict what "auto" may run without choosing: they bound it by every candidate (pre-flight's memory,
# before any layer has measured), so they never answer it.
PREDICT_AUTO = {"cocoweave.preflight.programs": "memory under 'auto': the most any candidate keeps"}


def test_every_auto_is_answered_by_tune_choose():
    """Every function that tests a schedule against "auto" (any module, a fourth one too) answers it through
    tune.choose, with its own fallback; tune's auto_schedule is choose with the compiler's fallback."""
    tune = ast.parse(MODULES["cocoweave.tune"].read_text(encoding="utf-8"))
    faces = [f for f in ast.walk(tune) if isinstance(f, ast.FunctionDef) and f.name == "auto_schedule"]
    assert faces and all("choose" in {c.func.id for c in ast.walk(f) if isinstance(c, ast.Call)
                                      and isinstance(c.func, ast.Name)} for f in faces)
    assert [f.name for f in ast.walk(tune) if isinstance(f, ast.FunctionDef) and f.name == "choose"] == ["choose"]
    unanswered = []
    for m, p in MODULES.items():
        if m.startswith("cocoweave.tune") or m in PREDICT_AUTO:
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for f in ast.walk(tree):
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and (lines := _compares_auto(f)) \
                    and not _reaches_an_answer(tree, f):
                unanswered.append(f"{m}.{f.name}:{lines[0]}")
    assert unanswered == [], "answer schedule='auto' with tune.choose(program, context, fallback)"
