"""The layers import only downward: graph_ir <- cann_passes <- recipes <- tools; the runtime and the
passes never import each other. Walks every import statement (function-level ones too)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Absolute module names imported by ``path`` (relative imports resolved against its package)."""
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
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def _files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO)} imports {name}" for path in _files(folder) for name in sorted(_imports(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("folder, forbidden", [
    ("graph_ir", ("cann_passes", "recipes", "tools")),
    ("cann_passes", ("recipes", "tools")),
    ("recipes", ("tools",)),
    ("cann_passes/runtime", ("cann_passes.passes",)),
    ("cann_passes/passes", ("cann_passes.runtime",)),
])
def test_layers_import_only_downward(folder, forbidden):
    assert _offenders(folder, forbidden) == []


def test_the_walk_sees_relative_imports():
    imports = _imports(REPO / "cann_passes" / "runtime" / "step.py")
    assert "cann_passes.compile" in imports and "cann_passes.runtime.binding" in imports
