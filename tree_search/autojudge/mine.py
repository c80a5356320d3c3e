"""AutoJudge mining (Algorithm 1 of the paper): label target/draft mismatches important or unimportant.

Per prompt: the target's greedy response y and its answer; the draft's teacher-forced argmax over y gives the
mismatches. The earliest mismatch t is tried: the draft token goes in and the target regenerates the rest. If the
answer is still equivalent the mismatch is unimportant and the search continues from the new response, otherwise it
is important and y is kept; then the next mismatch after t. Each mismatch is saved with its classifier feature, the
target's final hidden state at the draft token (`VerifyInput.hidden` of that node), in one safetensors file per
prompt, written atomically, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from mamba_draft.io import save_safetensors, write_json
from tree_search.autojudge.answers import AnswerTask

DraftLogits = Callable[[torch.Tensor], torch.Tensor]  # (1, L) ids -> (1, L, V) next-token logits


@dataclass
class Mismatch:
    position: int  # index in the response (0 = first generated token)
    target_token: int
    draft_token: int
    important: bool
    feature: torch.Tensor  # (H,) target final hidden state at the draft token's position


@torch.no_grad()
def target_greedy(target, ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The target's greedy continuation of `ids` (HF generate), up to and including EOS."""
    if max_new_tokens <= 0:
        return []
    device = next(target.parameters()).device
    prompt = torch.tensor([ids], device=device)
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=eos_token_id,
                          pad_token_id=eos_token_id if eos_token_id is not None else 0)
    new = out[0, len(ids):].tolist()
    if eos_token_id is not None and eos_token_id in new:
        new = new[: new.index(eos_token_id) + 1]
    return new


@torch.no_grad()
def draft_argmax(draft: DraftLogits, prompt: list[int], response: list[int], device) -> list[int]:
    """The draft's greedy choice for every response position given the same prefix (one parallel forward)."""
    ids = torch.tensor([prompt + response], device=device)
    logits = draft(ids)[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
    return logits.argmax(-1).tolist()


def mine_prompt(target, draft: DraftLogits, prompt: list[int], task: AnswerTask, decode: Callable[[list[int]], str],
                max_new_tokens: int, eos_token_id: int | None = None) -> tuple[list[Mismatch], list[int]]:
    """Algorithm 1 on one prompt. Returns the labelled mismatches and the final response."""
    if not prompt:
        raise ValueError("mine_prompt needs a non-empty prompt")
    device = next(target.parameters()).device  # the draft's too
    response = target_greedy(target, prompt, max_new_tokens, eos_token_id)
    reference = task.extract(decode(response))
    drafted = draft_argmax(draft, prompt, response, device)
    found: list[Mismatch] = []
    t = 0
    while True:
        t = next((i for i in range(t, len(response)) if response[i] != drafted[i]), None)
        if t is None:
            return found, response
        swapped = response[:t] + [drafted[t]]
        alternative = swapped + target_greedy(target, prompt + swapped, max_new_tokens - len(swapped), eos_token_id)
        important = not task.equivalent(reference, task.extract(decode(alternative)))
        with torch.no_grad():  # the target's final hidden state at the draft token
            out = target(input_ids=torch.tensor([prompt + swapped], device=device), output_hidden_states=True,
                         use_cache=False)
        feature = out.hidden_states[-1][0, -1].float().cpu()
        found.append(Mismatch(t, response[t], drafted[t], important, feature))
        if not important:  # keep the draft token and continue the search from the new response
            response = alternative
            drafted = draft_argmax(draft, prompt, response, device)
        t += 1


def save_prompt_record(path: Path, mismatches: Sequence[Mismatch], hidden_size: int, info: dict) -> None:
    """One prompt's mismatches as safetensors (features, labels, positions, tokens); `info` goes to metadata."""
    features = torch.stack([m.feature for m in mismatches]) if mismatches else torch.zeros(0, hidden_size)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    tensors = {
        "features": features.float().contiguous(),
        "labels": as_long([int(m.important) for m in mismatches]),
        "positions": as_long([m.position for m in mismatches]),
        "target_tokens": as_long([m.target_token for m in mismatches]),
        "draft_tokens": as_long([m.draft_token for m in mismatches]),
    }
    save_safetensors(path, tensors, {"info": json.dumps(info)})


def check_or_write_manifest(out_dir: Path, manifest: dict) -> None:
    """Refuse to resume into a directory mined with other models / task / settings; else record the settings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "manifest.json"
    if path.exists():
        previous = json.loads(path.read_text())
        if previous != manifest:
            changed = sorted(k for k in set(previous) | set(manifest) if previous.get(k) != manifest.get(k))
            raise ValueError(f"{out_dir} was mined with different settings ({', '.join(changed)}); "
                             "use another --out directory")
        return
    write_json(path, manifest, sort_keys=True)


def mine(target, draft: DraftLogits, prompts: Sequence[list[int]], task: AnswerTask, decode: Callable[[list[int]], str],
         out_dir: str | os.PathLike, max_new_tokens: int, eos_token_id: int | None = None,
         manifest: dict | None = None) -> dict[str, int]:
    """Mine every prompt not already done in `out_dir` (one file per prompt; created only here, once the models
    loaded, so a bad path or corrupt weights leave nothing behind). Returns counts for this call."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    out_dir = Path(out_dir)
    hidden_size = int(target.config.hidden_size)
    check_or_write_manifest(out_dir, {**(manifest or {}), "hidden_size": hidden_size, "max_new_tokens": max_new_tokens})
    counts = {"prompts": 0, "skipped": 0, "important": 0, "unimportant": 0}
    bar = tqdm(list(enumerate(prompts)), desc="mining mismatches", unit="prompt")
    for index, prompt in bar:
        path = out_dir / f"prompt_{index:06d}.safetensors"
        if path.exists():
            counts["skipped"] += 1
            continue
        found, response = mine_prompt(target, draft, list(prompt), task, decode, max_new_tokens, eos_token_id)
        info = {"prompt_index": index, "prompt_tokens": len(prompt), "final_response": decode(response)}
        save_prompt_record(path, found, hidden_size, info)
        counts["prompts"] += 1
        counts["important"] += sum(m.important for m in found)
        counts["unimportant"] += sum(not m.important for m in found)
        bar.set_postfix(important=counts["important"], unimportant=counts["unimportant"])
    return counts


def load_mined(out_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """All mined mismatches of a directory: features (N, H) and labels (N,), 1 = important."""
    out_dir = Path(out_dir)
    files = sorted(out_dir.glob("prompt_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no mined prompt files (prompt_*.safetensors) in {out_dir}; run `autojudge mine` first")
    records = [load_file(str(path)) for path in files]
    return torch.cat([r["features"] for r in records]), torch.cat([r["labels"] for r in records])
