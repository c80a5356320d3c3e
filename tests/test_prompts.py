"""Prompt-file parsing: Spec-Bench and `prompt` JSONL, and clear errors naming the bad line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mamba_draft.heldout import SPEC_BENCH
from tree_search.prompts import encode_prompt, load_prompts


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_spec_bench_records_use_first_turn_and_category(tmp_path):
    path = write(tmp_path / "q.jsonl", [
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}),
        "",
        json.dumps({"question_id": 161, "category": "translation", "turns": ["Translate: Hallo"]}),
    ])
    prompts = load_prompts(path)
    assert [(p.text, p.category, p.question_id) for p in prompts] == [
        ("Write a poem.", "writing", "81"), ("Translate: Hallo", "translation", "161")]


def test_prompt_records_default_category_and_selection(tmp_path):
    path = write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"p{i}", "category": "ab"[i % 2]}) for i in range(6)]
                 + [json.dumps({"prompt": "plain"})])
    assert load_prompts(path)[-1].category == "all"
    assert [p.text for p in load_prompts(path, per_category=2)] == ["p0", "p1", "p2", "p3", "plain"]
    assert len(load_prompts(path, limit=3)) == 3


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "ok"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "no prompt field"}', "record has neither 'turns' \\(Spec-Bench\\) nor 'prompt'"),
    ('{"turns": []}', "'turns' must be a non-empty list of strings"),
    ('{"prompt": 3}', "'prompt' must be a string"),
    ('{"prompt": "  "}', "empty prompt"),
    ('{"prompt": "x", "category": 5}', "'category' must be a non-empty string"),
])
def test_malformed_line_is_rejected_with_its_line_number(tmp_path, bad, message):
    path = write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine"}), "", bad, json.dumps({"prompt": "after"})])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: {message}"):
        load_prompts(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(write(tmp_path / "empty.jsonl", ["", "  "]))


def test_shipped_spec_bench_file_parses():
    prompts = load_prompts(SPEC_BENCH)
    assert len(prompts) == 480
    assert {"writing", "translation", "summarization", "qa", "math_reasoning", "rag"} <= {p.category for p in prompts}
    assert len(load_prompts(SPEC_BENCH, per_category=1)) == len({p.category for p in prompts})


def test_encode_prompt_uses_chat_template_when_present():
    from mamba_draft.benchmarks.corpus import train_tokenizer

    tok = train_tokenizer(["hello world, this is a test"] * 5, vocab_size=80)
    raw = encode_prompt(tok, "hello")
    assert raw == tok("hello")["input_ids"]
    tok.chat_template = "{% for m in messages %}<|bos|>{{ m['content'] }}{% endfor %}"
    templated = encode_prompt(tok, "hello")
    assert templated[0] == tok.bos_token_id and templated[1:] == raw
    assert encode_prompt(tok, "hello", use_chat_template=False) == raw


CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def test_encode_prompt_is_apply_chat_template_with_optional_system_message():
    from mamba_draft.benchmarks.corpus import train_tokenizer

    tok = train_tokenizer(["hello world, you are a helpful assistant user system"] * 5, vocab_size=120)
    tok.chat_template = CHATML

    def templated(messages, generation_prompt=True):
        ids = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    user = {"role": "user", "content": "hello"}
    system = {"role": "system", "content": "you are helpful"}
    assert encode_prompt(tok, "hello") == templated([user]) != templated([user], generation_prompt=False)
    assert encode_prompt(tok, "hello", system_prompt="you are helpful") == templated([system, user])
    with pytest.raises(ValueError, match="system prompt needs a chat template, but chat templates are off"):
        encode_prompt(tok, "hello", use_chat_template=False, system_prompt="you are helpful")
    tok.chat_template = None
    with pytest.raises(ValueError, match="but the tokenizer has no chat template"):
        encode_prompt(tok, "hello", system_prompt="you are helpful")
