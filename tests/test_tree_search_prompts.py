"""tree_search reads prompt files itself: it must never import `benchmarks` (benchmarks depends on tree_search)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import tree_search
from tree_search.prompts import encode_prompt, load_prompts

PACKAGE = Path(tree_search.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_tree_search_never_imports_benchmarks():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "autojudge" / "cli.py" in sources
    offenders = {str(p.relative_to(PACKAGE)): sorted(m for m in imported_modules(p) if m.split(".")[0] == "benchmarks")
                 for p in sources}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert "tree_search.prompts" in imported_modules(PACKAGE / "autojudge" / "cli.py")


def test_prompt_files_spec_bench_and_prompt_records(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([json.dumps({"question_id": 81, "category": "math", "turns": ["Add 2 and 3.", "More."]}),
                               "", json.dumps({"prompt": "Tom has 3 apples."})]) + "\n")
    prompts = load_prompts(path)
    assert [(p.text, p.category, p.question_id) for p in prompts] == [("Add 2 and 3.", "math", "81"),
                                                                      ("Tom has 3 apples.", "all", "")]
    assert len(load_prompts(path, limit=1)) == 1
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: record has neither 'turns'"):
        load_prompts(path)
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_encode_prompt_uses_the_chat_template_only_when_asked():
    class Tok:
        chat_template = "{{ messages }}"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [len(text)]}

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            return [7, len(messages[0]["content"])]

    assert encode_prompt(Tok(), "hello") == [7, 5]
    assert encode_prompt(Tok(), "hello", use_chat_template=False) == [5]
