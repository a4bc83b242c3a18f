"""The floors of the house, read from the source: runtime < partitioner < codegen < driver <
benchmarks.  No module imports from a higher floor, and no two of our modules import each
other, directly or round a circle (function-level imports included: a lazy import is still
an arrow).  `tests/runtime/test_package.py` keeps OR-Tools out of the runtime.  And what a
module loads when it runs: the planner's IR only the runtime's schedule IR ([Note: lazy
runtime] in runtime/__init__.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

FLOORS = {"runtime": 0, "partitioner": 1, "codegen": 2, "driver": 3, "benchmarks": 4}

#: the arrows up, on purpose, each an entry point the contract names on `partitioner`:
#: `python -m partitioner` is the driver's command line (partitioner/__main__.py only hands
#: over to it), and `partitioner.parallelize` is driver/parallelize.py's, read lazily
#: (partitioner/__init__.py imports it for type checking only)
ENTRY_POINTS = {("partitioner.__main__", "driver.cli"), ("partitioner", "driver.parallelize")}


def _modules() -> dict[str, Path]:
    """Every module of our packages by dotted name (a package by its own name)."""
    out = {}
    for package in FLOORS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The import statements under `if TYPE_CHECKING:` (annotations only, never run)."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(module imported, line, only for type checking) for each of `name`'s imports of our modules."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a package's attribute
                target = target.rpartition(".")[0]
            if target:
                out.append((target, node.lineno, node in typing_only))
    return out


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_module_imports_from_a_higher_floor() -> None:
    upward = [
        f"{name} (floor {FLOORS[name.split('.')[0]]}) line {line} imports {target} (floor {FLOORS[target.split('.')[0]]})"
        for name, imports in _graph().items() for target, line, _ in imports
        if FLOORS[target.split(".")[0]] > FLOORS[name.split(".")[0]] and (name, target) not in ENTRY_POINTS
    ]
    assert not upward, "imports that point up (runtime < partitioner < codegen < driver < benchmarks):\n" + \
        "\n".join(upward)


def test_no_import_cycle_between_our_modules() -> None:
    edges = {name: sorted({t for t, _, typing in imports if not typing and t != name and (name, t) not in ENTRY_POINTS})
             for name, imports in _graph().items()}
    cycles = [c for c in _strongly_connected(edges) if len(c) > 1]
    assert not cycles, "modules that import each other (round a circle):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_relative_and_lazy_imports() -> None:
    """The graph holds what a reader sees: a relative import, a module imported by name
    from its package, and an import inside a function."""
    graph = {name: {t for t, _, _ in imports} for name, imports in _graph().items()}
    assert "partitioner.ir" in graph["partitioner.solve.problem"]  # from ..ir import ...
    assert "partitioner.trace.model_file" in graph["driver.options"]  # from partitioner.trace import model_file
    assert "runtime.launch" in graph["driver.cli"]  # inside _run
    assert graph["partitioner.__main__"] == {"driver.cli"}


def _loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running `statement` in the repository."""
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.split())


def test_the_ir_loads_the_schedule_registry_and_nothing_heavy() -> None:
    """partitioner.ir reads the schedule registry through the runtime package, which loads
    none of the distributed runtime, checkpoints or the solver on the way."""
    loaded = _loaded_by("import partitioner.ir")
    ours = {m for m in loaded if m.split(".")[0] in FLOORS}
    light = {"runtime", "runtime.errors", "runtime.zero_bubble", "partitioner", "partitioner.ir"}
    assert {m for m in ours if m not in light and not m.startswith("runtime.schedule")} == set()
    assert "runtime.schedule.registry" in loaded
    assert not {"ortools", "torch.distributed", "networkx"} & loaded


def test_importing_the_runtime_loads_none_of_its_modules() -> None:
    loaded = _loaded_by("import runtime")
    assert {m for m in loaded if m.startswith("runtime.")} == set()


def _strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `edges`, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out
