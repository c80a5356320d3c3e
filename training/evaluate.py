"""Zero-shot multiple-choice accuracy (lm-eval-harness style acc / acc_norm) and held-out perplexity of a model,
and a drafter's held-out agreement with its target (top-1 agreement, expected accepted length tau_gamma).

    mamba-draft eval MODEL_DIR --tasks hellaswag,arc_easy,piqa,perplexity:heldout.jsonl
    mamba-draft eval MODEL_DIR --tasks hellaswag:local/hellaswag.jsonl   (a local file with the hub schema)
    mamba-draft eval DRAFTER --target TARGET --agreement heldout.json [--gammas 1,3,5] [--max-sequences N]
    mamba-draft eval DRAFTER --depths DATA_DIR [--max-sequences N]    (acceptance per depth and τ per tree shape on
                                                                      make-data replies)
"""
from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from mamba_draft.devices import check_device
from training.agreement import drafter_agreement, engine_depth_acceptance, pad_batch

DEFAULT_TASKS = "hellaswag,arc_easy,piqa"


@dataclass
class Item:
    context: str
    choices: list[str]
    gold: int


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_item(doc: dict) -> Item:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return Item(_hellaswag_clean(doc["activity_label"] + ": " + ctx),
                [_hellaswag_clean(e) for e in doc["endings"]], int(doc["label"]))


def arc_item(doc: dict) -> Item:
    gold = list(doc["choices"]["label"]).index(doc["answerKey"])
    return Item(f"Question: {doc['question']}\nAnswer:", list(doc["choices"]["text"]), gold)


def piqa_item(doc: dict) -> Item:
    return Item(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"]))


@dataclass
class Task:
    hub: tuple[str, str | None, str]       # (dataset id, config, split) as lm-eval-harness uses them
    columns: tuple[str, ...]
    to_item: Callable[[dict], Item]


TASKS = {
    "hellaswag": Task(("Rowan/hellaswag", None, "validation"), ("ctx_a", "ctx_b", "activity_label", "endings", "label"),
                      hellaswag_item),
    "arc_easy": Task(("allenai/ai2_arc", "ARC-Easy", "test"), ("question", "choices", "answerKey"), arc_item),
    "piqa": Task(("baber/piqa", None, "validation"), ("goal", "sol1", "sol2", "label"), piqa_item),
}


def parse_tasks(spec: str) -> list[tuple[str, str | None]]:
    """'hellaswag,arc_easy:file.jsonl,perplexity:held.jsonl' -> [(name, local file or None)], checked up front."""
    tasks = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, path = part.partition(":")
        if name != "perplexity" and name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)} or perplexity:FILE")
        if name == "perplexity" and not path:
            raise ValueError("perplexity needs a file: perplexity:FILE")
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"{name}: file {path} does not exist")
        tasks.append((name, path or None))
    if not tasks:
        raise ValueError("no tasks given")
    return tasks


def load_rows(path: str) -> datasets.Dataset:
    builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}.get(Path(path).suffix)
    if builder is None:
        raise ValueError(f"{path}: expected a .json, .jsonl, .parquet or .txt file")
    return datasets.load_dataset(builder, data_files=path, split="train")


def load_task(name: str, path: str | None, limit: int | None) -> list[Item]:
    task = TASKS[name]
    rows = load_rows(path) if path else datasets.load_dataset(task.hub[0], name=task.hub[1], split=task.hub[2])
    missing = [c for c in task.columns if c not in rows.column_names]
    if missing:
        raise ValueError(f"{name}: {path or task.hub[0]} lacks column(s) {missing}; it has {rows.column_names}")
    rows = rows.select(range(min(limit, len(rows)))) if limit else rows
    return [task.to_item(row) for row in rows]


@torch.no_grad()
def continuation_logprobs(model, tokenizer, context: str, continuations: list[str]) -> list[float]:
    """Sum of log p(continuation tokens | context) for each continuation, in one right-padded batch; as
    lm-eval-harness, context+continuation are encoded together and split at the context's token length."""
    device = next(model.parameters()).device
    ctx_ids = tokenizer(context, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
    start, seqs = len(ctx_ids), []
    for cont in continuations:
        whole = tokenizer(context + cont, add_special_tokens=False)["input_ids"]
        cont_ids = whole[start:] if whole[:start] == ctx_ids else tokenizer(cont, add_special_tokens=False)["input_ids"]
        seqs.append(ctx_ids + cont_ids)
    ids, mask, _ = pad_batch([(s, [True] * len(s)) for s in seqs], tokenizer.pad_token_id or 0)
    logprobs = F.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), -1).cpu()
    return [logprobs[i, start - 1:len(s) - 1].gather(-1, torch.tensor(s[start:])[:, None]).sum().item()
            for i, s in enumerate(seqs)]


def multiple_choice(model, tokenizer, items: list[Item], desc: str) -> dict:
    """acc: argmax log-likelihood; acc_norm: argmax log-likelihood / characters of the choice (lm-eval acc_norm)."""
    correct = correct_norm = 0
    for item in tqdm(items, desc=desc):
        scores = continuation_logprobs(model, tokenizer, item.context, [" " + c for c in item.choices])
        normed = [s / len(c) for s, c in zip(scores, item.choices)]
        correct += max(range(len(scores)), key=scores.__getitem__) == item.gold
        correct_norm += max(range(len(normed)), key=normed.__getitem__) == item.gold
    return {"acc": correct / len(items), "acc_norm": correct_norm / len(items), "n": len(items)}


@torch.no_grad()
def perplexity(model, tokenizer, path: str, max_len: int, text_column: str = "text") -> dict:
    """exp(mean NLL) over every token of every document (each document starts after an EOS, split in max_len windows)."""
    rows = load_rows(path)
    if text_column not in rows.column_names:
        raise ValueError(f"perplexity: {path} has no {text_column!r} column; it has {rows.column_names}")
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for text in tqdm(rows[text_column], desc="perplexity"):
        ids = [tokenizer.eos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - 1, max_len):
            window = torch.tensor(ids[start:start + max_len + 1], device=device)[None]
            logits = model(input_ids=window[:, :-1]).logits.float()
            nll += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
            count += window.size(1) - 1
    if count == 0:
        raise ValueError(f"perplexity: {path} holds no tokens")
    return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "tokens": count}


def evaluate(model_dir: str | Path, tasks: str, limit: int | None = None, max_len: int = 2048,
             device: str = "cpu") -> dict:
    """Run the tasks of a `--tasks` spec on an HF model directory; returns {task: metrics}."""
    parsed = parse_tasks(tasks)
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    results = {}
    for name, path in parsed:
        if name == "perplexity":
            results[f"perplexity:{Path(path).name}"] = perplexity(model, tokenizer, path, max_len)
        else:
            results[name] = multiple_choice(model, tokenizer, load_task(name, path, limit), name)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="HF-format model directory (e.g. from `mamba-draft export`); with "
                                          "--agreement, the drafter (HF or mamba_ssm format, or a hub id)")
    parser.add_argument("--tasks", default=None,
                        help="comma list of hellaswag, arc_easy, piqa (each optionally NAME:FILE for a local file "
                             f"with the hub schema) and perplexity:FILE (default {DEFAULT_TASKS}, unless only "
                             "--agreement is asked for)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N items of each task")
    parser.add_argument("--max-len", type=int, default=2048,
                        help="perplexity window length; agreement: tokens kept per sequence")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=None, help="also write the results as JSON to this file")
    group = parser.add_argument_group("drafter agreement with its target (teacher-forced, greedy)")
    group.add_argument("--target", default=None, help="the target: HF directory, hub id, .gguf file or 'smollm2'")
    group.add_argument("--agreement", metavar="FILE", default=None,
                       help="held-out chat file (ShareGPT conversations / messages, rendered with the target's chat "
                            "template, assistant tokens scored) or text file (.json, .jsonl, .parquet)")
    group.add_argument("--gammas", default="1,3,5", help="chain lengths for tau_gamma, comma separated")
    group.add_argument("--max-sequences", type=int, default=None, help="score only the file's first N records")
    group.add_argument("--batch-size", type=int, default=4, help="sequences per forward")
    group.add_argument("--depths", metavar="DATA_DIR", default=None,
                       help="acceptance per depth of greedy chains of 5 on a make-data directory's held-out replies "
                            "(the target's cached greedy choices; a drafter that reads the target gets the cached "
                            "states of the committed reply): depth1..depth5, chain_tau, and tree_tau, the τ of "
                            "static trees (1,1 / 1,1,1 / 2,1 / 2,2,1 / 3,2,2,1,1) under greedy verification")


def run(args: argparse.Namespace) -> int:
    if (args.agreement is None) != (args.target is None):
        raise SystemExit("mamba-draft eval: error: --agreement FILE and --target TARGET go together")
    if args.max_sequences is not None and args.max_sequences < 1:
        raise SystemExit(f"mamba-draft eval: error: --max-sequences must be >= 1, got {args.max_sequences}")
    results = {}
    try:
        check_device(args.device)
        try:
            gammas = tuple(int(g) for g in args.gammas.split(","))
        except ValueError:
            raise ValueError(f"--gammas expects comma-separated integers, got {args.gammas!r}") from None
        if args.tasks or not (args.agreement or args.depths):
            results.update(evaluate(args.model_dir, args.tasks or DEFAULT_TASKS, args.limit, args.max_len, args.device))
        if args.depths:
            results[f"depths:{Path(args.depths).name}"] = engine_depth_acceptance(
                args.model_dir, args.depths, max_replies=args.max_sequences, device=args.device)
        if args.agreement:
            results[f"agreement:{Path(args.agreement).name}"] = drafter_agreement(
                args.model_dir, args.target, args.agreement, gammas=gammas, max_sequences=args.max_sequences,
                max_len=args.max_len, batch_size=args.batch_size, device=args.device)
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise SystemExit(f"mamba-draft eval: error: {err}") from None
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0
