"""Package layering: mamba_draft owns the model and imports none of the others; training never imports
tree_search; tree_search never imports training or benchmarks (benchmarks sits on top of everything); no import cycle inside a
package (function-level imports count: a cycle hidden in a function is still one)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "mamba_draft": {"tree_search", "training", "benchmarks"},
    "training": {"tree_search", "benchmarks"},
    "tree_search": {"training", "benchmarks"},
}


def imported_top_level_packages(path: Path) -> set[str]:
    """Every absolute import in a source file, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layering(package):
    sources = sorted((REPO / package).rglob("*.py"))
    assert sources, f"no sources found for {package}"
    offenders = {str(p.relative_to(REPO)): sorted(imported_top_level_packages(p) & FORBIDDEN[package])
                 for p in sources}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_checker_sees_function_level_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from tree_search.prompts import load_prompts\n    import benchmarks.demo\n")
    assert imported_top_level_packages(source) == {"tree_search", "benchmarks"}


def module_imports(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (absolute imports, at top level or inside functions)."""
    root = REPO / package
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name and m != package}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


@pytest.mark.parametrize("package", ["tree_search", "mamba_draft"])
def test_no_import_cycle_inside_a_package(package):
    assert find_cycle(module_imports(package)) is None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
