"""mamba_draft.io (atomic writes), mamba_draft.dtypes (the one dtype table), and the verifier package's import graph."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mamba_draft.dtypes import DTYPES, dtype_name, parse_dtype
from mamba_draft.io import atomic_directory, atomic_path, save_safetensors, write_bytes, write_json, write_text

REPO = Path(__file__).resolve().parents[1]
VERIFIERS = REPO / "tree_search" / "verifiers"


# ---------------------------------------------------------------- atomic writes


def test_writers_replace_the_file_and_leave_nothing_else(tmp_path):
    path = tmp_path / "sub" / "out.json"  # missing parent directories are created
    write_json(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")
    write_text(path, "new")
    assert path.read_text() == "new"
    write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    save_safetensors(tmp_path / "t.safetensors", {"x": torch.arange(3)}, {"k": "v"})
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["x"], torch.arange(3))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # a plain open()'s mode, not a temp file's 0600
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out.json", "sub", "t.safetensors"]


def _raising_serializer(tmp: Path) -> None:
    tmp.write_bytes(b"half of the new conte")
    raise RuntimeError("serializer failed midway")


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "record.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_path(path) as tmp:
            _raising_serializer(tmp)
    with pytest.raises(ValueError, match="expected torch.Tensor"):  # refused after the temporary exists
        save_safetensors(path, {"x": "not a tensor"})
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_json(path, {"x": float("nan")})  # strict JSON
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["record.safetensors"]


def test_atomic_directory_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("weights failed")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in out.iterdir()] == ["config.json"]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        with atomic_directory(out):
            pass
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "other").write_text("")
    assert [p.name for p in out.iterdir()] == ["other"] and [p.name for p in tmp_path.iterdir()] == ["model"]


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name, alias, dtype", [("float32", "fp32", torch.float32),
                                                ("bfloat16", "bf16", torch.bfloat16),
                                                ("float16", "fp16", torch.float16)])
def test_dtype_names_round_trip(name, alias, dtype):
    assert parse_dtype(name) is dtype and parse_dtype(alias) is dtype and parse_dtype(dtype) is dtype
    assert dtype_name(parse_dtype(alias)) == name and DTYPES[name] is dtype
    assert list(DTYPES) == ["float32", "bfloat16", "float16"]  # benchmarks' --dtype choices, in this order


def test_dtype_errors_are_one_line():
    with pytest.raises(ValueError) as err:
        parse_dtype("float64")
    assert str(err.value) == "unknown dtype 'float64'; choose one of float32/fp32, bfloat16/bf16, float16/fp16"
    with pytest.raises(ValueError, match="'auto'"):
        parse_dtype("auto")  # only where the caller's loader accepts it
    assert parse_dtype("auto", auto=True) == "auto"
    with pytest.raises(ValueError, match="choose one of auto, float32/fp32"):
        parse_dtype("half", auto=True)
    with pytest.raises(ValueError, match="torch.int64 has no name"):
        dtype_name(torch.int64)


# ---------------------------------------------------------------- verifier package imports


def _sibling_imports(path: Path) -> set[str]:
    """Verifier modules `path` imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "tree_search.verifiers":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tree_search.verifiers."):
            found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("tree_search.verifiers.")}
    return found


def test_verifier_modules_import_without_a_loop():
    modules = {p.stem: p for p in VERIFIERS.glob("*.py") if p.stem != "__init__"}
    graph = {name: _sibling_imports(path) & set(modules) for name, path in modules.items()}
    assert "lossy" in graph["combine"] and not graph["base"]  # the contract and registry import no sibling

    def visit(name, stack):
        assert name not in stack, f"import loop: {' -> '.join([*stack, name])}"
        for dep in graph[name]:
            visit(dep, [*stack, name])

    for name in graph:
        visit(name, [])


def test_every_verifier_module_imports_first_in_a_fresh_interpreter():
    modules = sorted(p.stem for p in VERIFIERS.glob("*.py") if p.stem != "__init__")
    # one interpreter (torch loads once); the repository's modules are dropped and re-imported for each order
    probe = """
import importlib, sys
modules = sys.argv[1:]
for first in modules:
    for name in [m for m in sys.modules if m == "tree_search" or m.startswith("tree_search.")]:
        del sys.modules[name]
    for name in [first, *reversed(modules)]:
        importlib.import_module(f"tree_search.verifiers.{name}")
    from tree_search.verifiers import available_verifiers, get_verifier
    assert {"anyof", "autojudge", "dropmatch", "fly", "greedy", "sampling", "topk"} <= set(available_verifiers())
    assert get_verifier("topk+fly", k=3).verifiers[0].k == 3
print("ok", len(modules))
"""
    result = subprocess.run([sys.executable, "-c", probe, *modules], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok", str(len(modules))]
