"""Arrows point down: a package imports only packages below it, at run time.

    kv < policies < scheduler < engine < deployments < benchmarks

Imports under `if TYPE_CHECKING:` name types for annotations and are not run, so they may
point anywhere. The one arrow up is the `fairbatch` program itself: deployments/cli.py
registers `fairbatch bench`, whose parser lives with the benchmarks (benchmarks/cli.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["kv", "policies", "scheduler", "engine", "deployments", "benchmarks"]
ENTRY = {("deployments/cli.py", "fairbatch.benchmarks")}  # the program registers `bench`


def run_time_imports(tree: ast.AST) -> list[str]:
    """The fairbatch modules a file imports, leaving out `if TYPE_CHECKING:` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [m for m in found if m.startswith("fairbatch.")]


def test_packages_import_only_the_layers_below_them():
    upward = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for module in run_time_imports(ast.parse(path.read_text(encoding="utf-8"))):
                target = module.split(".")[1]
                if target not in LAYERS or LAYERS.index(target) <= LAYERS.index(layer):
                    continue
                if (rel, module) not in ENTRY:
                    upward.append(f"{rel} imports {module}")
    assert upward == []


def test_the_check_sees_an_arrow_up():
    code = "from typing import TYPE_CHECKING\nimport fairbatch.engine.core\n"
    code += "if TYPE_CHECKING:\n    from fairbatch.deployments import cli\n"
    code += "def f():\n    from fairbatch.benchmarks import serve_bench\n"
    got = run_time_imports(ast.parse(code))
    assert got == ["fairbatch.engine.core", "fairbatch.benchmarks"]
