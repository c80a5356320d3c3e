"""Chat records: ShareGPT `conversations` or `messages` turns -> chat messages, and the template used when a
tokenizer has none. Kept apart from `training.data` (which needs `datasets`) so the data engine runs where only
torch and transformers are installed (a GPU machine's image)."""
from __future__ import annotations

from mamba_draft.heldout import is_heldout_text

# Used when the tokenizer has no chat template: the Zephyr format from alignment-handbook
# (recipes/zephyr-7b-beta), one `<|role|>\n...{eos}` block per turn.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def normalize_conversation(record: dict, evaluation: bool = False) -> tuple[list[dict] | None, str]:
    """ShareGPT `conversations[{from, value}]` or `messages[{role, content}]` -> chat messages, or (None, reason).

    A user turn that is an odd-id Spec-Bench question skips the record ("heldout_question") unless `evaluation`:
    training, distillation and tuning data never hold evaluation prompts."""
    if record.get("conversations") is not None:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif record.get("messages") is not None:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        return None, "missing_conversation"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or turn.get(role_key) is None or turn.get(text_key) is None:
            return None, "missing_field"
        role = ROLES.get(turn[role_key])
        if role is None:
            return None, "unknown_role"
        if not str(turn[text_key]).strip():
            return None, "empty_turn"
        if role == "user" and not evaluation and is_heldout_text(turn[text_key]):
            return None, "heldout_question"
        messages.append({"role": role, "content": turn[text_key]})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        return None, "empty_conversation"
    if [m["role"] for m in body] != (["user", "assistant"] * len(body))[:len(body)]:
        return None, "non_alternating"
    if body[-1]["role"] == "user":
        messages = messages[:-1]  # a trailing question without an answer teaches nothing
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant_turn"
    return messages, ""
