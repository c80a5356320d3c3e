"""Package layering, every boundary: mamba_draft (drafters, target loading) imports none of the others; training and
tree_search import only mamba_draft; the apps live under mamba_draft's namespace but above every package:
mamba_draft.benchmarks sits on mamba_draft, tree_search and training, and mamba_draft.commands (the `mamba-draft`
dispatcher) may import them all. A module's layer is the longest prefix of its name that names one. Imports count
wherever they are and however written: absolute or relative, at top level, inside functions, and by string
(`importlib.import_module("x.y")`, and the dispatcher's COMMANDS table of module names, which it imports lazily). No
import cycle inside a package either (a cycle hidden in a function is still one)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALLOWED = {
    "mamba_draft": set(),
    "training": {"mamba_draft"},
    "tree_search": {"mamba_draft"},
    "mamba_draft.benchmarks": {"mamba_draft", "tree_search", "training"},
    "mamba_draft.commands": {"mamba_draft", "tree_search", "training", "mamba_draft.benchmarks"},
}
PACKAGES = {layer.split(".")[0] for layer in ALLOWED}  # the installed top-level names
TABLES = {"COMMANDS"}  # module-level tables whose strings name modules imported lazily


def module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "text"` assignments (an import_module(NAME) argument is resolved through them)."""
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def string_imports(tree: ast.Module) -> set[str]:
    """Modules imported by name: `importlib.import_module(...)` / `import_module(...)` / `__import__(...)` calls with
    a literal (or a module-level constant) argument, and the strings of a dispatch table (TABLES) that name one of
    the packages."""
    constants, found = module_constants(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            arg = node.args[0]
            if name in ("import_module", "__import__"):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
                elif isinstance(arg, ast.Name) and arg.id in constants:
                    found.add(constants[arg.id])
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign)
                   else [])
        if any(isinstance(t, ast.Name) and t.id in TABLES for t in targets) and node.value is not None:
            found |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                      and c.value.split(".")[0] in PACKAGES and " " not in c.value}
    return found


def imported_modules(path: Path) -> set[str]:
    """Every import of a source file, at top level, inside functions or by string (`string_imports`), relative ones
    resolved against the file's package (`from .model import X` in mamba_draft/checkpoint.py is mamba_draft.model);
    `from a import b` counts as a and a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = string_imports(tree)
    inside = path.resolve().is_relative_to(REPO)
    parts = list(path.resolve().relative_to(REPO).with_suffix("").parts) if inside else [path.stem]
    package = parts[:-1]  # the package a relative import starts from (an __init__'s own)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def imported_top_level_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name: the longest prefix of it that ALLOWED names (None: not one of ours)."""
    parts = module.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in ALLOWED), None)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def layer_sources(layer: str) -> list[Path]:
    """The source files whose modules belong to `layer` (a package's subpackage of another layer is not its)."""
    return sorted(p for p in (REPO / layer.replace(".", "/")).rglob("*.py") if layer_of(module_name(p)) == layer)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_package_imports_respect_the_layering(layer):
    sources = layer_sources(layer)
    assert sources, f"no sources found for {layer}"
    forbidden = set(ALLOWED) - ALLOWED[layer] - {layer}
    offenders = {str(p.relative_to(REPO)): sorted({layer_of(m) for m in imported_modules(p)} & forbidden)
                 for p in sources}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_apps_are_not_top_level_packages():
    """Nothing installs a generic top-level name such as `benchmarks` or `commands` beside the packages."""
    tops = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    assert tops == PACKAGES


def test_the_checker_sees_function_level_and_string_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import importlib\nSTEP = 'training.train'\n"
                      "def f():\n    from tree_search.prompts import load_prompts\n    import mamba_draft.benchmarks.demo\n"
                      "    importlib.import_module('mamba_draft.commands.cli')\n    return importlib.import_module(STEP)\n"
                      "COMMANDS: dict = {'x': ('mamba_draft.convert', 'convert a model, see tree_search.cli')}\n")
    assert imported_top_level_packages(source) == {"importlib", "tree_search", "training", "mamba_draft"}
    assert {layer_of(m) for m in imported_modules(source)} - {None} == {
        "tree_search", "mamba_draft.benchmarks", "mamba_draft.commands", "training", "mamba_draft"}


def test_the_checker_resolves_relative_imports():
    """`from .model import X` inside a function of mamba_draft/checkpoint.py is mamba_draft.model; `from . import
    targets` in a package's __init__ is that package's targets; `from ..x import y` goes one package up."""
    found = imported_modules(REPO / "mamba_draft" / "targets" / "cpu_step.py")
    assert {"mamba_draft.targets.native", "mamba_draft.targets.facts.cache_keyword"} <= found
    package = imported_modules(REPO / "mamba_draft" / "targets" / "__init__.py")
    assert {"mamba_draft.targets.row_attention", "mamba_draft.io"} <= package
    assert "mamba_draft.checkpoint" in imported_modules(REPO / "mamba_draft" / "model.py")


def test_the_dispatcher_table_is_seen_as_imports():
    """The table names a module of every package: were the dispatcher inside one of them, the layering would fail."""
    seen = {layer_of(m) for m in imported_modules(REPO / "mamba_draft" / "commands" / "cli.py")}
    assert {"mamba_draft", "tree_search", "training", "mamba_draft.benchmarks"} <= seen


def module_imports(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (absolute imports, at top level, inside functions or by string)."""
    modules = {module_name(p): p for p in (REPO / package.replace(".", "/")).rglob("*.py")}
    return {name: {m for m in imported_modules(path) if m in modules and m != name and m != package}
            for name, path in modules.items()}


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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycle_inside_a_package(package):
    assert find_cycle(module_imports(package)) is None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
