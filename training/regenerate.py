"""Regenerate assistant replies with the target model (self-distillation data).

    python -m training.regenerate --target TARGET --input conversations.json --output regenerated.json

TARGET: an HF directory, a hub id, a .gguf file, or `smollm2` (the shipped SmolLM2 GGUF). Input: a ShareGPT JSON
array, or JSONL with one record per line: ShareGPT (`conversations`), `{"messages": [...]}`, `{"prompt": str}`, or
Spec-Bench (`question_id`, `category`, `turns`: the first turn is the user message).

User and system turns are kept; every assistant turn is replaced by the target's reply to the conversation so far,
and a conversation ending with a user turn gets the target's reply appended. Round k generates the k-th reply of
every record, so later turns see the regenerated earlier ones. A reply that reaches --max-new-tokens without an
end-of-sequence token is truncated: --truncated mark keeps its record with `"truncated": true`, drop skips it.

Output: ShareGPT JSON, `[{id, category (if given), conversations: [{from, value}], truncated (if marked)}]`, written
atomically; when every record is skipped, nothing is written and the command fails.

`mamba-draft regenerate` takes the same arguments plus --drafter: the same replies, produced by batched tree
speculative decoding (mamba_draft/benchmarks/regenerate.py passes `regenerate(..., generate=...)` its own batch generator).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LogitsProcessorList

from mamba_draft.devices import check_device, resolve_dtype
from mamba_draft.io import write_json
from mamba_draft.targets import load_causal_lm
from training.chat import FALLBACK_CHAT_TEMPLATE, ROLES, normalize_conversation
from training.model import load_tokenizer

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}
DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # auto: bfloat16 where native (devices.default_dtype)
TRUNCATED = ("mark", "drop")


# ------------------------------------------------------------------------------------------------ input

def read_records(source: str | os.PathLike | list) -> list:
    """A JSON array file, a JSONL file (one record per line), or an in-memory list of records (returned as is)."""
    if isinstance(source, list):
        return source
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a valid JSON array ({e.msg} at line {e.lineno})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
    return records


def conversation(record, index: int) -> tuple[dict | None, str]:
    """One input record -> {id, [category], messages} where every assistant message is a reply to generate,
    or (None, skip reason)."""
    if not isinstance(record, dict):
        return None, "not_an_object"
    chat = record
    is_chat = record.get("conversations") is not None or record.get("messages") is not None
    if not is_chat and ("turns" in record or "prompt" in record):  # a prompt (Spec-Bench: its first turn)
        turns = record["turns"] if "turns" in record else [record["prompt"]]
        text = turns[0] if isinstance(turns, list) and turns else None
        if not (isinstance(text, str) and text.strip()):
            return None, "bad_prompt"
        chat = {"messages": [{"role": "user", "content": text}]}
    key, role, content = (("conversations", "from", "value") if chat.get("conversations") is not None
                          else ("messages", "role", "content"))
    turns = chat.get(key)
    if isinstance(turns, list) and turns and isinstance(turns[-1], dict) and ROLES.get(turns[-1].get(role)) == "user":
        # A slot for the reply to this last user turn (SFT would drop the unanswered turn instead).
        chat = {key: [*turns, {role: "assistant", content: "<reply>"}]}
    messages, reason = normalize_conversation(chat)
    if messages is None:
        return None, reason
    category = {"category": record["category"]} if isinstance(record.get("category"), str) else {}
    return {"id": str(record.get("id", record.get("question_id", index))), **category, "messages": messages}, ""


# ------------------------------------------------------------------------------------------- generation

def target_tokenizer(model: str | os.PathLike):
    tokenizer = load_tokenizer(str(model))
    tokenizer.padding_side = "left"  # right padding would put pads between the prompt and the reply
    return tokenizer


def eos_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (chat models end turns with e.g. <|eot_id|>)."""
    extra = model.generation_config.eos_token_id
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([tokenizer.eos_token_id, *extra]))


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    template = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# A batch generator: (model, tokenizer, prompts, *, max_new_tokens, temperature, eos_token_ids, seed | top_p) -> each
# prompt's new tokens, ending at its first EOS or cut at max_new_tokens. temperature 0 is greedy; above 0 it samples
# with the target's generation_config top-k / top-p (make-data: top_p None keeps it). seed: this batch's seed (a
# generator that draws from torch's global RNG, seeded by the caller, may ignore it).
Generate = Callable[..., list[list[int]]]


def load_target(target: str | os.PathLike, device: str, dtype: torch.dtype):
    """The target that makes data (regenerate, make-data): training data needs speed, not batch invariance, so no
    row blocks and the fastest batched attention: grouped on CPU (sdpa copies the repeated key heads), else sdpa."""
    return load_causal_lm(target, dtype=dtype, device=device, row_blocks=False,
                          attn_implementation="grouped" if torch.device(device).type == "cpu" else "sdpa")


class TopKSampler:
    """A logits processor that draws the next token itself — temperature, then top-k, then top-p, as transformers'
    sampling warpers do — and leaves only that token's score finite, so `generate`'s greedy pick takes it. Unlike
    transformers' top-p it never sorts the whole vocabulary: the draw is over the top k only."""

    def __init__(self, temperature: float, top_k: int | None, top_p: float | None):
        self.temperature, self.top_k, self.top_p = temperature, top_k or 0, 1.0 if top_p is None else top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1]) if self.top_k > 0 else scores.shape[-1]
        values, ids = (scores.float() / self.temperature).topk(k, dim=-1)  # sorted, highest first
        probs = torch.softmax(values, dim=-1)
        if self.top_p < 1.0:  # keep the highest tokens until their mass reaches top_p (the first always)
            probs = probs.masked_fill(probs.cumsum(-1) - probs >= self.top_p, 0.0)
        token = ids.gather(-1, torch.multinomial(probs, 1))
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)


@torch.no_grad()
def hf_sample(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
              eos_token_ids: list[int], top_p: float | None = None, seed: int | None = None) -> list[list[int]]:
    """The default `Generate`: transformers' `generate` on the left-padded batch with a static cache, sampling with
    `TopKSampler` from torch's global RNG (`seed` is not used: the callers seed that RNG)."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(model.device)
    config = model.generation_config
    processors = [TopKSampler(temperature, config.top_k if config.top_k is not None else 50,
                              top_p or config.top_p)] if temperature > 0 else []
    # a static cache: the default one grows by concatenation, copying the whole batch's KV cache every step
    out = model.generate(**batch, max_new_tokens=max_new_tokens, eos_token_id=eos_token_ids,
                         pad_token_id=tokenizer.pad_token_id, cache_implementation="static", do_sample=False,
                         logits_processor=LogitsProcessorList(processors))
    return out[:, batch["input_ids"].size(1):].tolist()


def cut_at_eos(row: list[int], eos_ids: list[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """(tokens before the first EOS, True when no EOS came within max_new_tokens)."""
    row = row[:max_new_tokens]
    end = next((j for j, t in enumerate(row) if t in eos_ids), None)
    return (row, True) if end is None else (row[:end], False)


def generate_replies(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     eos_ids: list[int], generate: Generate | None, seed: int | None) -> list[tuple[str, bool]]:
    """One left-padded batch -> (reply text, truncated) per prompt; generate None: `hf_sample`."""
    rows = (generate or hf_sample)(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                   temperature=temperature, eos_token_ids=eos_ids, seed=seed)
    if len(rows) != len(prompts):
        raise RuntimeError(f"the batch generator returned {len(rows)} replies for {len(prompts)} prompts")
    return [(tokenizer.decode(ids, skip_special_tokens=True).strip(), cut)
            for ids, cut in (cut_at_eos(row, eos_ids, max_new_tokens) for row in rows)]


def regenerate(model: str | os.PathLike, source: str | os.PathLike | list, output: str | os.PathLike, *,
               max_new_tokens: int = 512, temperature: float = 0.0, batch_size: int = 8, truncated: str = "mark",
               limit: int | None = None, seed: int = 0, device: str = "cpu", dtype: str = "auto",
               progress: bool = True, generate: Generate | None = None) -> Counter:
    """Write the regenerated conversations of `source` (a file or a list of records) to `output` (ShareGPT JSON).

    Returns counts {"written": n, "truncated": t, <skip reason>: m, ...}: every record is written or skipped for
    exactly one reason (in mark mode the truncated records are among the written ones). Raises ValueError or
    FileNotFoundError, writing nothing, on bad input or when every record is skipped.

    generate: how a batch of replies is produced (`Generate`; None: `hf_sample`). torch's global RNG is seeded with
    `seed` once; a batch whose first reply is the n-th of the run gets seed `seed + n`, so reply n has seed + n
    whatever the batch size (for a generator seeding row b of a batch with seed + b)."""
    if truncated not in TRUNCATED:
        raise ValueError(f"truncated must be one of {TRUNCATED}, got {truncated!r}")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if batch_size < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError("batch_size and max_new_tokens must be >= 1 and temperature >= 0")
    output = Path(output)
    if not output.resolve().parent.is_dir():
        raise FileNotFoundError(f"output directory {output.parent} does not exist")
    records = read_records(source)[:limit]
    parsed = [conversation(record, i) for i, record in enumerate(records)]
    counts = Counter(reason for conv, reason in parsed if conv is None)
    convs = [conv for conv, _ in parsed if conv is not None]
    if not convs:  # before loading the model
        raise ValueError(f"nothing to write: all {len(records)} input records were skipped ({summary(counts)})")

    tokenizer = target_tokenizer(model)
    lm = load_target(model, device, resolve_dtype(dtype, device))
    eos_ids = eos_token_ids(tokenizer, lm)
    torch.manual_seed(seed)
    slots = [[j for j, m in enumerate(c["messages"]) if m["role"] == "assistant"] for c in convs]
    fate = [""] * len(convs)  # skip reason once a record is dropped; its later replies are not generated
    cut = [False] * len(convs)
    generated = 0  # replies generated so far: the next batch's seed offset
    # closed on an error too, so the one-line error starts on a line of its own
    with tqdm(total=sum(map(len, slots)), desc="regenerate", unit="reply", disable=not progress) as bar:
        for k in range(max(map(len, slots))):
            todo = [i for i in range(len(convs)) if not fate[i] and k < len(slots[i])]
            ids = {i: prompt_ids(tokenizer, convs[i]["messages"][:slots[i][k]]) for i in todo}
            todo.sort(key=lambda i: -len(ids[i]))  # similar lengths share a batch; the longest batch runs first
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                replies = generate_replies(lm, tokenizer, [ids[i] for i in batch], max_new_tokens, temperature,
                                           eos_ids, generate, seed + generated)
                generated += len(batch)
                for i, (text, was_cut) in zip(batch, replies):
                    convs[i]["messages"][slots[i][k]] = {"role": "assistant", "content": text}
                    cut[i] |= was_cut
                    # SFT would reject an empty turn; the original is not silently kept
                    fate[i] = "empty_reply" if not text else "truncated" if was_cut and truncated == "drop" else ""
                    if fate[i]:
                        bar.total -= len(slots[i]) - k - 1
                bar.update(len(batch))

    out = []
    for conv, reason, was_cut in zip(convs, fate, cut):
        if reason:
            counts[reason] += 1
            continue
        record = {key: conv[key] for key in ("id", "category") if key in conv}
        record["conversations"] = [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in conv["messages"]]
        if was_cut:
            record["truncated"] = True
            counts["truncated"] += 1
        out.append(record)
    counts["written"] = len(out)
    if not out:
        raise ValueError(f"nothing to write: all {len(records)} records were skipped ({summary(counts, truncated)})")
    write_json(output, out, ensure_ascii=False, indent=1)
    return counts


def summary(counts: Counter, truncated: str | None = None) -> str:
    """`written 70, truncated 5 (marked), empty_reply 1, non_alternating 2`; skip reasons only without `truncated`."""
    mode = "dropped" if truncated == "drop" else "marked"
    parts = [] if truncated is None else [f"written {counts['written']}", f"truncated {counts['truncated']} ({mode})"]
    parts += [f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("written", "truncated") and v]
    return ", ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (without --threads), shared with `mamba-draft regenerate`."""
    parser.add_argument("--target", required=True, help="target: HF dir, hub id, .gguf file or 'smollm2'")
    parser.add_argument("--input", required=True, help="ShareGPT JSON array, or JSONL of conversations or prompts")
    parser.add_argument("--output", required=True, help="where to write the regenerated ShareGPT JSON")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--batch-size", type=int, default=8, help="replies generated together (left-padded)")
    parser.add_argument("--truncated", choices=TRUNCATED, default="mark",
                        help="replies that hit --max-new-tokens: mark the record, or drop it")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N input records")
    parser.add_argument("--seed", type=int, default=0)
    add_device_arguments(parser)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype of the commands that load a target to make data (regenerate, make-data)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bfloat16 where native (CUDA, AVX512-BF16/AMX CPUs), else float32")


MINIMUMS = (("max_new_tokens", 1), ("batch_size", 1), ("limit", 1), ("temperature", 0))  # of `add_arguments`


def check_arguments(args: argparse.Namespace, minimums=MINIMUMS) -> None:
    """ValueError on an argument below its minimum (before anything is read or loaded); None: not given."""
    for name, least in minimums:
        if getattr(args, name) is not None and getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}")


def run(args: argparse.Namespace, generate: Generate | None = None) -> Counter:
    """Regenerate with parsed `add_arguments` arguments, which both callers have passed through `check_arguments`;
    raises ValueError / OSError / ImportError on bad input (nothing written). generate: as in `regenerate`."""
    check_device(args.device)
    return regenerate(args.target, args.input, args.output, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, batch_size=args.batch_size, truncated=args.truncated,
                      limit=args.limit, seed=args.seed, device=args.device, dtype=args.dtype, generate=generate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.regenerate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    try:
        check_arguments(args, MINIMUMS + (("threads", 1),))
    except ValueError as e:
        parser.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        counts = run(args)
    except (ValueError, OSError, ImportError) as e:
        print(f"{parser.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"regenerate: {summary(counts, args.truncated)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
