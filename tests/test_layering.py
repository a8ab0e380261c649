"""The layers import only downward: graph_ir <- cann_passes <- recipes <- tools; inside cann_passes,
passes <- pipeline (the plan's reader) <- compiling <- planning <- the step driver, and the runtime
only binds and runs. No two project modules import each other, directly or around a circle.
Walks every import statement (function-level ones too)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path, submodules: set[str] | None = None) -> set[str]:
    """Absolute module names imported by ``path`` (relative imports resolved against its package).

    With ``submodules`` (the project's module names), ``from pkg import name`` counts as an import of
    ``pkg.name`` alone where that is a module (not of ``pkg``'s ``__init__``), for the circle check."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = {f"{module}.{alias.name}" for alias in node.names}
            if submodules is None:
                found |= {module} | names
            else:
                found |= {n if n in submodules else module for n in names}
    return found


def _files(folder: str) -> list[Path]:
    path = REPO / folder
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO)} imports {name}" for path in _files(folder) for name in sorted(_imports(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


PLANNING = ("cann_passes.planning", "cann_passes.simulate", "cann_passes.figures", "cann_passes.reports")
# The backends themselves (what a pass may know of a target is its converter coverage, ge_offline).
BACKENDS = ("cann_passes.lowering.base", "cann_passes.lowering.registry", "cann_passes.lowering.eager",
            "cann_passes.lowering.inductor", "cann_passes.lowering.torchair")
DRIVER = ("cann_passes.step", "cann_passes.api", "cann_passes.torch_compile_backend")


@pytest.mark.parametrize("folder, forbidden", [
    ("graph_ir", ("cann_passes", "recipes", "tools")),
    ("cann_passes", ("recipes", "tools")),
    ("recipes", ("tools",)),
    # the runtime binds and runs: it never compiles, plans or drives
    ("cann_passes/runtime", ("cann_passes.passes", "cann_passes.compile", "cann_passes.pass_pipeline",
                             "cann_passes.pass_manager", *PLANNING, *DRIVER)),
    # a pass reads its graph, its options and the mesh: never the plan or anything above it
    ("cann_passes/passes", ("cann_passes.runtime", "cann_passes.plan", "cann_passes.pass_pipeline",
                            "cann_passes.compile", *BACKENDS, *PLANNING, *DRIVER)),
    ("cann_passes/pass_manager.py", ("cann_passes.plan", "cann_passes.pass_pipeline", "cann_passes.compile",
                                     "cann_passes.lowering", *PLANNING, *DRIVER)),
    ("cann_passes/dump.py", ("cann_passes.compile", "cann_passes.pass_manager", *PLANNING, *DRIVER)),
    # compiling takes a plan whose choices are made: it imports nothing of planning
    ("cann_passes/compile.py", (*PLANNING, *DRIVER, "cann_passes.runtime")),
    ("cann_passes/lowering", ("cann_passes.compile", "cann_passes.plan", "cann_passes.pass_pipeline",
                              "cann_passes.runtime", *PLANNING, *DRIVER)),
    ("cann_passes/planning.py", DRIVER),
    ("cann_passes/simulate.py", DRIVER),
    # what a compiled program costs is read from the program: no compiling there
    ("cann_passes/figures.py", ("cann_passes.compile", "cann_passes.planning", "cann_passes.simulate",
                                "cann_passes.pass_manager", *DRIVER)),
])
def test_layers_import_only_downward(folder, forbidden):
    assert _offenders(folder, forbidden) == []


def _module_graph() -> nx.DiGraph:
    """Project module -> the project modules it imports (``from pkg import name`` names the submodule
    where ``name`` is one; anything else names the longest project module that is a prefix)."""
    modules = {}
    for folder in ("graph_ir", "cann_passes", "recipes", "tools"):
        for path in _files(folder):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for name in _imports(path, submodules=set(modules)):
            target = resolve(name)
            if target and target != module:
                graph.add_edge(module, target)
    return graph


def test_no_import_circles_among_project_modules():
    circles = [sorted(c) for c in nx.strongly_connected_components(_module_graph()) if len(c) > 1]
    assert circles == []


def test_the_circle_check_sees_function_level_imports(tmp_path, monkeypatch):
    graph = _module_graph()
    graph.add_edge("cann_passes.compile", "cann_passes.planning")   # what a lazy import inside compile would add
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))


def test_the_walk_sees_relative_and_function_level_imports():
    imports = _imports(REPO / "cann_passes" / "step.py")
    assert "cann_passes.planning" in imports and "cann_passes.runtime.binding" in imports
    assert "cann_passes.passes" in _imports(REPO / "cann_passes" / "compile_cache.py")   # inside a method
