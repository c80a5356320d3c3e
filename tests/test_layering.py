"""Package layering: mamba_draft owns the model and imports none of the others; training never imports
tree_search; tree_search never imports training or benchmarks (benchmarks sits on top of everything)."""
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
