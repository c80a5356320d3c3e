"""Regenerate the assistant turns of a ShareGPT file with the target model (self-distillation data).

    python -m training.regenerate --model TARGET_DIR --input sharegpt.json --output regenerated.json

User (and system) turns are kept; every assistant turn is replaced by the target's own reply to the
conversation so far (rendered with the target's chat template, or the documented fallback). The output
is ShareGPT JSON (`[{id, conversations: [{from, value}]}]`), written atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from training.data import FALLBACK_CHAT_TEMPLATE, normalize_conversation
from training.model import load_tokenizer

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


@torch.no_grad()
def reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float) -> str:
    template = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True).strip()


def regenerate(model_dir: str, input_path: str, output_path: str, max_new_tokens: int = 512,
               temperature: float = 0.0, limit: int | None = None, seed: int = 0, device: str = "cpu") -> Counter:
    """Write the regenerated conversations; returns counts {"written": n, <skip reason>: m, ...}."""
    records = json.loads(Path(input_path).read_text())
    if not isinstance(records, list):
        raise ValueError(f"{input_path}: expected a JSON array of ShareGPT records")
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    torch.manual_seed(seed)
    counts, out = Counter(), []
    for i, record in enumerate(tqdm(records[:limit] if limit else records, desc="regenerate")):
        messages, reason = normalize_conversation(record)
        if messages is None:
            counts[reason] += 1
            continue
        new = []
        for m in messages:
            if m["role"] == "assistant":
                m = {"role": "assistant", "content": reply(model, tokenizer, new, max_new_tokens, temperature)}
            new.append(m)
        if any(not m["content"] for m in new):
            counts["empty_reply"] += 1  # SFT would reject it as an empty turn; the original is not silently kept
            continue
        out.append({"id": str(record.get("id", i)),
                    "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in new]})
        counts["written"] += 1
    path = Path(output_path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    os.replace(tmp, path)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.regenerate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="target model (HF dir or hub id)")
    parser.add_argument("--input", required=True, help="ShareGPT JSON file")
    parser.add_argument("--output", required=True, help="where to write the regenerated ShareGPT JSON")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if not Path(args.input).is_file():
        parser.error(f"--input {args.input} does not exist")
    if not Path(args.output).resolve().parent.is_dir():
        parser.error(f"--output directory {Path(args.output).parent} does not exist")
    counts = regenerate(args.model, args.input, args.output, args.max_new_tokens, args.temperature,
                        args.limit, args.seed, args.device)
    print(f"regenerate: {dict(counts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
