"""Prompt files: Spec-Bench JSONL (`turns`, `category`) or plain JSONL with a `prompt` field, and their encoding
(here, not in benchmarks, as AutoJudge mining reads prompt files too)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mamba_draft.heldout import is_heldout_text


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = "all"
    question_id: str = ""


def parse_prompt_line(line: str, where: str) -> Prompt:
    """One JSONL record -> Prompt. Spec-Bench records use their first turn (later turns need the model's answer)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        text = turns[0]
    elif "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
    else:
        raise ValueError(f"{where}: record has neither 'turns' (Spec-Bench) nor 'prompt'; keys: {sorted(record)}")
    if not text.strip():
        raise ValueError(f"{where}: empty prompt")
    category = record.get("category", "all")
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string")
    return Prompt(text=text, category=category, question_id=str(record.get("question_id", record.get("id", ""))))


SPLITS = ("all", "heldout", "train")


def load_prompts(path: str | Path, limit: int | None = None, per_category: int | None = None,
                 split: str = "all") -> list[Prompt]:
    """Read every line of a prompt file (validating all of them; blank lines skipped) -> the selected prompts.

    `split`: "heldout" keeps only odd-id Spec-Bench questions (evaluation), "train" drops them, "all" keeps every
    line. `per_category` then keeps the first N prompts of each category, `limit` caps the total.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    with path.open(encoding="utf-8") as f:
        prompts = [parse_prompt_line(line, f"{path}:{n}") for n, line in enumerate(f, start=1) if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    if split != "all":
        prompts = [p for p in prompts if is_heldout_text(p.text) == (split == "heldout")]
        if not prompts:
            raise ValueError(f"{path}: no {split} prompts (held-out = odd-id Spec-Bench questions)")
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit is not None else prompts


def encode_prompt(tokenizer, text: str, use_chat_template: bool = True, system_prompt: str | None = None) -> list[int]:
    """Token ids for one prompt: the tokenizer's chat template when it has one (an optional system turn, the user
    turn, the generation prompt), else the raw text, which takes no system prompt."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if system_prompt is not None:
        reason = "chat templates are off" if not use_chat_template else "the tokenizer has no chat template"
        raise ValueError(f"a system prompt needs a chat template, but {reason}")
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
