"""The data engine: a chat target writes its own prompts (Magpie) and answers them, greedy and sampled.

    mamba-draft make-data --target smollm2 --out DIR --magpie 4096 [--magpie-tasks 2048] [--prompts FILE ...]
        [--temperatures 0,0.7]

Prompts come from the target itself (Magpie, Xu et al. 2024: sample what follows the chat template's user-turn
header; with --magpie-tasks after a system turn naming a kind of task, `TASKS`) and from user prompt files (as
`regenerate` reads them). A generated prompt is kept when it ended its turn, is new, reads as a request and shares
no 8-word run with a held-out Spec-Bench question; every drop is counted by reason. Every prompt is answered at
each temperature (0 = greedy; > 0 samples with the target's generation_config top-k / top-p) in left-padded
batches sorted by length.

DIR is append-only and resumable: rerun the same command after an interruption (even SIGKILL) and it loses at most
the batch in flight; a larger --magpie extends a finished run.
    manifest.json         settings and counts (rewritten atomically after every batch)
    prompts.jsonl         {id, source, prompt, batch[, task]}: every accepted prompt
    magpie.jsonl          {batch, samples, kept, dropped{reason: n}}: one line per finished Magpie batch
    magpie-tasks.jsonl    the same for steered batches (and their task)
    replies-T{t}.jsonl    {id, source, temperature, truncated, reply_ids, topk, conversations}: ShareGPT records
                          that `training.train` reads as SFT / distillation data
    topk-T{t}.bin         the target's top-K next-token log-probabilities at every reply position (the end-of-turn
                          one too), from the generating forward at temperature 1: per position K int32 ids then K
                          float16 log-probs; a record's `topk` is [first position, count]
    hidden-T{t}.bin       with --hidden: the target's last hidden state after its final norm at the same positions,
                          bfloat16, hidden_size values per position (`read_hidden`)
Replies made elsewhere travel without their row files: copy the .jsonl files into DIR and rerun; their missing rows
come from one teacher-forced forward before anything new is made.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from mamba_draft.devices import check_device, resolve_dtype
from mamba_draft.heldout import is_heldout, is_heldout_text, normalize, overlaps_heldout, read_spec_bench
from mamba_draft.io import write_json, write_text
from training.regenerate import (
    SHAREGPT_ROLE, Generate, add_device_arguments, check_arguments, conversation, cut_at_eos, eos_token_ids, hf_sample,
    load_target, prompt_ids, read_records, target_tokenizer,
)

MAGPIE_TEMPERATURE, MAGPIE_TOP_P, MAGPIE_TOKENS = 0.9, 0.95, 96
TOPK = 20  # cached target log-probs per reply position
ROUND_BATCHES = 8  # Magpie batches (of each kind) between two reply passes
TASK_SEED = 1 << 20  # steered batch b samples with seed + TASK_SEED + b (plain batch b: seed + b)
REPLY_ROW_TOKENS = 512  # tokens (prompt + reply cap) per row of a full reply batch: longer prompts get fewer rows


@dataclass(frozen=True)
class Task:
    """A kind of request Magpie is steered to write (`--magpie-tasks`), of up to `tokens` tokens, by a system turn
    before the user turn (the reply is still written under the default template)."""
    name: str
    system: str
    tokens: int = MAGPIE_TOKENS
    instruction: str = ""  # appended to a document's text: what the user asks of it
    document: bool = False  # a pasted text (cut back to a full sentence), not a request to check as one


# Generic instruction-tuning task kinds (Magpie's domain-steered variants): unsteered, a small target writes
# near-identical requests ("Can you provide a list of ..."), and never a long text to work on.
TASKS = (
    Task("math", "You are a math tutor. The user gives you a math word problem with numbers and asks you to solve "
         "it step by step."),
    Task("python", "You are a programming assistant. The user asks you to write, explain or fix a Python function."),
    Task("code", "You are a programming assistant. The user asks a question about JavaScript, SQL, C++ or the shell, "
         "often with a code snippet."),
    Task("science", "You are a science teacher. The user asks you to explain a concept in physics, chemistry, "
         "biology or computer science."),
    Task("humanities", "You are a knowledgeable assistant. The user asks about history, philosophy, economics, law "
         "or literature."),
    Task("writing", "You are a writing assistant. The user asks you to write a story, a poem, an email, a speech or "
         "a blog post on a given topic."),
    Task("roleplay", "You are an actor. The user asks you to play a character, such as a famous person, a doctor "
         "or a pirate, and to answer in role."),
    Task("reasoning", "You are a logical thinker. The user gives you a puzzle or riddle and asks you to reason "
         "about it step by step."),
    Task("translation", "You are a translator. The user gives you a sentence in French, German or Spanish and asks "
         "you to translate it into English."),
    Task("facts", "You are an encyclopedia. The user asks a short factual question about people, places, dates or "
         "events."),
    Task("editing", "You are an editor. The user gives you a few sentences with mistakes and asks you to correct or "
         "rewrite them."),
    Task("advice", "You are a helpful assistant. The user asks for advice or a plan for a situation in their work, "
         "studies, health or daily life."),
    Task("article", "You are a news writer. Write a news article.", 256,
         "Summarize the article above in a few sentences.", document=True),
    Task("passage", "You are a writer. Write an informative passage about a topic.", 256,
         "Extract the key facts from the text above as a list.", document=True),
    Task("report", "You are a journalist. Write a short report about an event.", 256,
         "Based on the text above, answer: who was involved, what happened, and when?", document=True),
)
PLAIN = Task("plain", "")  # unsteered Magpie: the template's default system turn
# --magpie-styles: batch b is steered by real questions, STYLE_EXEMPLARS even-id Spec-Bench questions of one category
# (in turn) quoted in the system turn, each cut to STYLE_WORDS words; a category whose questions are documents
# (summaries, retrieved passages: median over STYLE_WORDS words) is sampled up to STYLE_DOCUMENT_TOKENS and cut back
# to its last full sentence. Odd ids, the evaluation set, are never shown.
STYLE_EXEMPLARS, STYLE_WORDS, STYLE_DOCUMENT_TOKENS = 3, 60, 320
STYLE_SEED = 2 << 20  # style batch b samples with seed + STYLE_SEED + b
FOLLOW_UP_SEED = 3 << 20  # follow-up batch b samples with seed + FOLLOW_UP_SEED + b
FOLLOW_UP_WORDS = 150  # a first turn longer than this (a pasted text) gets no Magpie follow-up
_SENTENCE_END = re.compile(r"[.!?][\"')\]]?(?=\s|$)")
_SENTINEL = "\u2063MAGPIE\u2063"  # an invisible separator: marks where the user's text would start
_REQUEST_START = re.compile(
    r"^(what|how|why|when|where|which|who|whom|whose|is|are|can|could|would|will|should|do|does|did|write|create|"
    r"explain|describe|give|list|tell|help|make|generate|compose|draft|summari[sz]e|translate|find|calculate|solve|"
    r"compare|suggest|provide|design|develop|analy[sz]e|imagine|i\s+(need|want|would|am|have|'m)|please|let's|"
    r"show|implement|convert|rewrite|edit|plan|recommend|name|define|discuss|outline|prepare|identify|evaluate)\b",
    re.IGNORECASE)
# the assistant's side, or the system turn echoed (style batches quote requests in it)
_ASSISTANT_VOICE = re.compile(r"^(i'm smollm|i am smollm|as an ai|hello! i|hi! i|sure[,!]|certainly[,!]|"
                              r"you are an? [\w ]*assistant|i'?m an? (new )?ai\b|i am an? (new )?ai\b)", re.IGNORECASE)


# ------------------------------------------------------------------------------------------ shards

def read_shard(path: Path) -> list[dict]:
    """The records of an append-only JSONL file, after cutting a torn last line (a write killed mid-line); a bad
    line elsewhere is an error: only the tail can be torn by an interrupted append."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # torn tail: keep every complete line
        os.truncate(path, end)
        data = data[:end]
    records = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number}: not valid JSON (not an interrupted append: the file was "
                             "changed by hand or is not make-data's)") from None
    return records


def append_shard(path: Path, records: list[dict]) -> None:
    """One write of whole lines, flushed to disk before returning: a kill loses at most this batch."""
    if records:
        append_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def reply_path(out: Path, temperature: float) -> Path:
    return out / f"replies-T{temperature:g}.jsonl"


def topk_path(out: Path, temperature: float) -> Path:
    return out / f"topk-T{temperature:g}.bin"


def hidden_path(out: Path, temperature: float) -> Path:
    return out / f"hidden-T{temperature:g}.bin"


def topk_bytes() -> int:
    return TOPK * (4 + 2)


def rows_end(records: list[dict]) -> int:
    """The position after the last row the reply records point at."""
    return max((r["topk"][0] + r["topk"][1] for r in records if r.get("topk")), default=0)


def read_rows(path: Path, record: dict, row_bytes: int) -> torch.Tensor:
    """A reply's rows in a per-position file: (positions, row_bytes) uint8."""
    start, count = record["topk"]
    with open(path, "rb") as f:
        f.seek(start * row_bytes)
        return torch.frombuffer(bytearray(f.read(count * row_bytes)), dtype=torch.uint8).view(count, row_bytes)


def read_topk(out: Path, temperature: float, record: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A reply's cached (positions, K) int64 ids and float32 log-probs."""
    raw = read_rows(topk_path(out, temperature), record, topk_bytes())
    return raw[:, :TOPK * 4].view(torch.int32).long(), raw[:, TOPK * 4:].view(torch.float16).float()


def read_hidden(out: Path, temperature: float, record: dict, width: int) -> torch.Tensor:
    """A reply's cached (positions, width) bfloat16 hidden states, aligned with its top-K rows (that the file holds
    them all, `engine_data.check_hidden_width` checks)."""
    return read_rows(hidden_path(out, temperature), record, width * 2).view(torch.bfloat16)


# ------------------------------------------------------------------------------------------ prompts

def magpie_prefix(tokenizer, system: str = "", history: list[dict] = ()) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (`system`'s turn, or the template's
    default one, and the `history` of earlier turns included): what the target continues to write a user request."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--magpie needs a target with a chat template (the prompt is sampled after its user-turn "
                         "header); pass --magpie 0 and --prompts FILE instead")
    turns = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template([*turns, *history, {"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user's message verbatim; cannot find the user turn")
    return tokenizer(text[:text.index(_SENTINEL)], add_special_tokens=False)["input_ids"]


def request_verdict(text: str) -> str:
    """'' when a generated text reads as a user request, else the reason it is dropped."""
    words = text.split()
    if len(words) < 3:
        return "too_short"
    if len(words) > 300:
        return "too_long"
    if not re.search(r"[A-Za-z]", text):
        return "no_words"
    if _ASSISTANT_VOICE.match(text):
        return "assistant_voice"
    if not (text.rstrip().endswith("?") or _REQUEST_START.match(text.lstrip(" \"'*#-"))):
        return "not_a_request"
    return ""


def document_prompt(text: str, cut: bool, task: Task) -> tuple[str, str]:
    """(prompt, '') for a pasted text of a document task — cut back to its last full sentence when the sample hit
    its cap, then the task's request if it has one — or ('', reason) when it is dropped."""
    if cut:
        ends = list(_SENTENCE_END.finditer(text))
        if not ends:
            return "", "cut"
        text = text[:ends[-1].end()]
    if len(text.split()) < 40:
        return "", "too_short"
    if _ASSISTANT_VOICE.match(text):
        return "", "assistant_voice"
    return (f"{text}\n\n{task.instruction}" if task.instruction else text), ""


def style_tasks(questions: list[dict], batches: int, seed: int) -> list[Task]:
    """The steering of `batches` style batches: batch b quotes STYLE_EXEMPLARS questions of category
    b % categories (sorted by name) drawn with seed + b. Only even-id questions: odd ids are refused here."""
    if any(is_heldout(q) or any(is_heldout_text(t) for t in q["turns"]) for q in questions):
        raise ValueError("style exemplars must not include held-out (odd-id) Spec-Bench questions")
    names = sorted({q["category"] for q in questions})
    tasks = []
    for b in range(batches):
        name = names[b % len(names)]
        pool = [q for q in questions if q["category"] == name]
        shown = random.Random(seed + b).sample(pool, min(STYLE_EXEMPLARS, len(pool)))
        quoted = "\n\n".join(f"Request {i + 1}: {cut_words(q['turns'][0], STYLE_WORDS)}" for i, q in enumerate(shown))
        words = sorted(len(q["turns"][0].split()) for q in pool)
        document = words[len(words) // 2] > STYLE_WORDS
        tasks.append(Task(f"style:{name}", "You are a helpful assistant. Users send requests like these:\n\n"
                          f"{quoted}\n\nThe next user sends a new request of the same kind, on another subject.",
                          STYLE_DOCUMENT_TOKENS if document else MAGPIE_TOKENS, document=document))
    return tasks


def cut_words(text: str, words: int) -> str:
    parts = text.split()
    return " ".join(parts[:words]) + (" ..." if len(parts) > words else "")


def file_prompts(paths: list[str], seen: set[str]) -> tuple[list[dict], Counter]:
    """User prompt files -> new prompt records (their first user turn; a Spec-Bench question's later turns wait in
    `next_turns` for the reply to the first, `follow_ups`) and drop counts; `seen` gains their keys."""
    kept, dropped = [], Counter()
    for path in paths:
        stem = Path(path).stem
        for i, record in enumerate(read_records(path)):
            conv, reason = conversation(record, i)  # held-out questions come back as "heldout_question"
            if conv is not None:
                text = next(m["content"] for m in conv["messages"] if m["role"] == "user")
                if normalize(text) in seen:
                    reason = "duplicate"
            if reason:
                dropped[reason] += 1
                continue
            seen.add(normalize(text))
            later = record.get("turns", [])[1:]  # a kept record is a dict
            kept.append({"id": f"{stem}:{conv['id']}", "source": stem, "prompt": text, "batch": -1}
                        | ({"next_turns": later} if later and all(isinstance(t, str) and t.strip() for t in later)
                           else {}))
    return kept, dropped


def prompt_messages(record: dict) -> list[dict]:
    """A prompt record's chat: the earlier turns of a follow-up (`history`), then its user turn."""
    return [*record.get("history", []), {"role": "user", "content": record["prompt"]}]


# ------------------------------------------------------------------------------------------ generation

def pack_topk(logits: torch.Tensor) -> torch.Tensor:
    """(positions, topk_bytes()) uint8 top-K file rows of (positions, V) logits: the TOPK most likely next tokens'
    int32 ids, then their float16 log-probs."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(TOPK, dim=-1)
    packed = (x.view(torch.uint8).reshape(ids.shape[0], -1) for x in (ids.to(torch.int32), values.to(torch.float16)))
    return torch.cat(list(packed), dim=1)


class Engine:
    """The target, its tokenizer and a batch generator, with a tokens/s meter for the progress bar."""

    def __init__(self, model, tokenizer, generate: Generate):
        self.model, self.tokenizer, self.generate = model, tokenizer, generate
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.tokens, self.seconds = 0, 0.0

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float | None,
            seed: int, record_topk: bool = False, record_hidden: bool = False,
            ) -> tuple[list[tuple[list[int], bool]], list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """Each prompt's (reply tokens before EOS, cut), with `record_topk` its top-K file rows (`pack_topk`) and
        with `record_hidden` the head's input at those positions, (positions, hidden_size) bfloat16 (None when the
        generator ran no forward of this model, e.g. a scripted one)."""
        torch.manual_seed(seed)
        steps, states = [], []  # per decoding step: packed top-K rows, the head's inputs

        def record(module, inputs, output):  # each decoding step's head output: (B, 1, V) (prefill: last position)
            steps.append(pack_topk(output[:, -1]))
            if record_hidden:
                states.append(inputs[0][:, -1].to(torch.bfloat16))

        hook = self.model.get_output_embeddings().register_forward_hook(record) if record_topk else None
        # transformers compiles a static-cache forward on CUDA: a hook inside a CUDA-graphed forward reads buffers
        # the next replay overwrites, and each batch's new hook recompiles it. Rows come from an eager forward.
        config = self.model.generation_config
        own_setting = config.disable_compile
        config.disable_compile = record_topk or own_setting
        start = time.perf_counter()
        try:
            rows = self.generate(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, eos_token_ids=self.eos_ids)
        finally:
            config.disable_compile = own_setting
            if hook is not None:
                hook.remove()
        self.seconds += time.perf_counter() - start
        if len(rows) != len(prompts):
            raise RuntimeError(f"the batch generator returned {len(rows)} rows for {len(prompts)} prompts")
        out = [cut_at_eos(list(row), self.eos_ids, max_new_tokens) for row in rows]
        counts = [len(ids) + (not cut) for ids, cut in out]  # the EOS is a generated token too
        self.tokens += sum(counts)
        needed = max(counts)
        if not record_topk or len(steps) < needed:
            return out, None, None

        def per_reply(rows: list[torch.Tensor]) -> list[torch.Tensor]:  # one copy to the host, cut per reply
            stacked = torch.stack(rows[:needed], dim=1).cpu()  # (B, positions, ...)
            return [stacked[b, :n] for b, n in enumerate(counts)]

        return out, per_reply(steps), per_reply(states) if record_hidden else None

    def rate(self) -> str:
        return f"{self.tokens / self.seconds:.0f} tok/s" if self.seconds else "-"


@dataclass(frozen=True)
class MagpieKind:
    """One kind of Magpie batch: its prompt ids `{tag}:{batch}:{row}`, source name, log file and seed offset."""
    tag: str
    source: str
    log: str
    seed: int


PLAIN_KIND = MagpieKind("magpie", "magpie", "magpie.jsonl", 0)
TASK_KIND = MagpieKind("task", "magpie_task", "magpie-tasks.jsonl", TASK_SEED)
STYLE_KIND = MagpieKind("style", "magpie_style", "magpie-styles.jsonl", STYLE_SEED)


def magpie_batches(engine: Engine, out: Path, count: int, batch_size: int, seed: int, seen: set[str],
                   prompts_path: Path, progress: bool, on_batch: Callable[[], None],
                   kind: MagpieKind = PLAIN_KIND, tasks: tuple[Task, ...] = (PLAIN,)) -> None:
    """Sample Magpie batches of `kind` until `count` samples have been drawn in all; each finished batch appends
    its kept prompts, then its summary line (a batch without one is redone; `seen` drops the re-drawn copies).
    Batch b is steered by tasks[b % len(tasks)]."""
    log_path = out / kind.log
    done = {r["batch"] for r in read_shard(log_path)}
    todo = [b for b in range(-(-count // batch_size)) if b not in done]
    if not todo:
        return
    bar = tqdm(total=len(todo) * batch_size, desc=f"{kind.source} prompts", unit="sample", disable=not progress)
    for b in todo:
        task = tasks[b % len(tasks)]
        tag = {} if kind is PLAIN_KIND else {"task": task.name}
        n = min(batch_size, count - b * batch_size)
        rows, _, _ = engine.run([magpie_prefix(engine.tokenizer, task.system)] * n, task.tokens, MAGPIE_TEMPERATURE,
                                MAGPIE_TOP_P, seed + b + kind.seed)
        kept, dropped = [], Counter()
        for row, (ids, cut) in enumerate(rows):
            text = engine.tokenizer.decode(ids, skip_special_tokens=True).strip()
            if task.document:
                text, reason = document_prompt(text, cut, task)
            else:
                reason = "cut" if cut else request_verdict(text)
            if not reason and normalize(text) in seen:
                reason = "duplicate"
            elif not reason and overlaps_heldout(text):
                reason = "heldout_overlap"
            if reason:
                dropped[reason] += 1
                continue
            seen.add(normalize(text))
            kept.append({"id": f"{kind.tag}:{b}:{row}", "source": kind.source, "prompt": text, "batch": b} | tag)
        append_shard(prompts_path, kept)
        append_shard(log_path, [{"batch": b, "samples": n, "kept": len(kept), "dropped": dict(dropped)} | tag])
        on_batch()
        bar.update(n)
        bar.set_postfix(kept=len(kept), speed=engine.rate())
    bar.close()


def length_batches(sizes: list[int], batch_size: int, row_tokens: int = REPLY_ROW_TOKENS) -> list[tuple[int, int]]:
    """[start, stop) spans of `sizes` (tokens per row, longest first) holding at most `batch_size` rows and
    `batch_size * row_tokens` tokens (a single row may exceed it): a batch's KV cache stays bounded."""
    spans, start, budget = [], 0, batch_size * row_tokens
    while start < len(sizes):
        rows = max(1, min(batch_size, budget // max(1, sizes[start])))
        spans.append((start, min(len(sizes), start + rows)))
        start = spans[-1][1]
    return spans


def reply_batches(engine: Engine, out: Path, prompts: list[dict], temperatures: list[float], max_new_tokens: int,
                  batch_size: int, seed: int, progress: bool, on_batch: Callable[[], None], hidden: bool) -> None:
    """Answer every prompt at every temperature it lacks a reply for, longest prompts first. The generating
    forward's rows (with `hidden` its hidden states too) append at `rows_end` (`teacher_forced` has levelled the files
    with the replies, and fills in the rows of a reply whose forward the hook did not see)."""
    next_position, encoded, jobs = {}, {}, []
    for t in temperatures:
        records = read_shard(reply_path(out, t))
        next_position[t] = rows_end(records)
        have = {r["id"] for r in records}
        pending = [p for p in prompts if p["id"] not in have]
        # only what is still to answer: a late round re-reads every prompt but encodes few
        encoded |= {p["id"]: prompt_ids(engine.tokenizer, prompt_messages(p)) for p in pending
                    if p["id"] not in encoded}
        pending.sort(key=lambda p: -len(encoded[p["id"]]))
        sizes = [len(encoded[p["id"]]) + max_new_tokens for p in pending]
        jobs += [(t, pending[i:j]) for i, j in length_batches(sizes, batch_size)]
    bar = tqdm(total=sum(len(batch) for _, batch in jobs), desc="replies", unit="reply", disable=not progress)
    for t, batch in jobs:
        # the seed depends on the batch's content, not its position: a resumed run draws the same way per batch
        batch_seed = seed + sum(map(ord, batch[0]["id"])) * 1009 + int(t * 1000)
        rows, topk, states = engine.run([encoded[p["id"]] for p in batch], max_new_tokens, t, None, batch_seed,
                                        record_topk=True, record_hidden=hidden)
        records = []
        for b, (p, (ids, cut)) in enumerate(zip(batch, rows)):
            text = engine.tokenizer.decode(ids, skip_special_tokens=True).strip()
            span = None if topk is None else [next_position[t], topk[b].size(0)]
            next_position[t] += span[1] if span else 0
            chat = [*prompt_messages(p), {"role": "assistant", "content": text}]
            records.append({"id": p["id"], "source": p["source"], "temperature": t, "truncated": cut,
                            "reply_ids": ids, "topk": span, "conversations": [
                                {"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in chat]})
        if states is not None:  # hidden, then top-K, then the reply lines: a kill leaves only a tail to cut
            append_bytes(hidden_path(out, t), torch.cat(states).view(torch.uint8).numpy().tobytes())
        if topk is not None:  # the positions first: a reply line never points past the end of the top-K file
            append_bytes(topk_path(out, t), b"".join(row.numpy().tobytes() for row in topk))
        append_shard(reply_path(out, t), records)
        on_batch()
        bar.update(len(batch))
        bar.set_postfix(speed=engine.rate())
    bar.close()


def follow_ups(engine: Engine, out: Path, temperatures: list[float], count: int, batch_size: int, seed: int,
               prompts_path: Path, progress: bool, on_batch: Callable[[], None]) -> int:
    """Later user turns after the target's own reply (its greedy one, else the first temperature's): a Spec-Bench
    question's next turn (`next_turns`), and for up to `count` first turns the target wrote (Magpie, not pasted
    documents) a follow-up it writes itself (Magpie after the conversation so far; each first turn is tried once).
    Each Magpie batch is logged in follow-ups.jsonl (a batch without its line is redone); returns the prompts added."""
    replies = {r["id"]: r for r in read_shard(reply_path(out, 0.0 if 0.0 in temperatures else temperatures[0]))}
    prompts = read_shard(prompts_path)
    have = {p["id"] for p in prompts}

    def chat(p: dict) -> list[dict]:
        return [*prompt_messages(p), {"role": "assistant", "content": replies[p["id"]]["conversations"][-1]["value"]}]

    def child(p: dict) -> str:
        return f"{p['id']}/{len(p.get('history', [])) // 2 + 2}"

    turns = [{"id": child(p), "source": p["source"], "prompt": p["next_turns"][0], "batch": -1, "history": chat(p)}
             | ({"next_turns": p["next_turns"][1:]} if len(p["next_turns"]) > 1 else {})
             for p in prompts if p.get("next_turns") and p["id"] in replies and child(p) not in have]
    append_shard(prompts_path, turns)
    log_path = out / "follow-ups.jsonl"
    log = read_shard(log_path)
    tried = {parent for line in log for parent in line["parents"]}
    eligible = sorted((p for p in prompts if p["source"].startswith("magpie") and "history" not in p
                       and p["id"] in replies and not replies[p["id"]]["truncated"] and p["id"] not in tried
                       and len(p["prompt"].split()) <= FOLLOW_UP_WORDS), key=lambda p: zlib.crc32(p["id"].encode()))
    eligible = eligible[:max(0, count - len(tried))]
    bar = tqdm(total=len(eligible), desc="follow-up prompts", unit="sample", disable=not progress or not eligible)
    added = len(turns)
    for b, start in enumerate(range(0, len(eligible), batch_size), start=len(log)):
        batch = eligible[start:start + batch_size]
        rows, _, _ = engine.run([magpie_prefix(engine.tokenizer, history=chat(p)) for p in batch], MAGPIE_TOKENS,
                                MAGPIE_TEMPERATURE, MAGPIE_TOP_P, seed + FOLLOW_UP_SEED + b)
        kept, dropped = [], Counter()
        for p, (ids, cut) in zip(batch, rows):
            text = engine.tokenizer.decode(ids, skip_special_tokens=True).strip()
            # the same follow-up to another first turn is no copy
            reason = "cut" if cut else request_verdict(text) or ("heldout_overlap" if overlaps_heldout(text) else "")
            if reason:
                dropped[reason] += 1
                continue
            kept.append({"id": child(p), "source": "follow_up", "prompt": text, "batch": b, "history": chat(p)})
        append_shard(prompts_path, kept)
        append_shard(log_path, [{"batch": b, "parents": [p["id"] for p in batch], "samples": len(batch),
                                 "kept": len(kept), "dropped": dict(dropped)}])
        added += len(kept)
        on_batch()
        bar.update(len(batch))
    bar.close()
    return added


def cut_to_replies(path: Path, records: list[dict], row_bytes: int) -> int:
    """Cut a per-position file (top-K or hidden rows) back to its last whole reply; returns the positions it covers."""
    size = path.stat().st_size if path.exists() else 0
    done = rows_end([r for r in records if r.get("topk") and sum(r["topk"]) * row_bytes <= size])
    if size != done * row_bytes:
        os.truncate(path, done * row_bytes)
    return done


HIDDEN_PAIR_BUDGET = 1 << 22  # rows x length^2 of one teacher forward: bounds its attention scores (~150 MB)


@torch.no_grad()
def teacher_forced(engine: Engine, out: Path, prompts: dict[str, list[dict]], temperature: float, hidden: bool,
                   progress: bool, on_batch: Callable[[], None]) -> None:
    """Append the rows the generating forward would have recorded for the replies whose rows the files lack: top-K
    rows and, with `hidden`, final-norm hidden states. Row j of a reply is the distribution its token j was drawn
    from, at sequence position len(prompt) - 1 + j of one teacher-forced forward over prompt + reply. Replies go in
    top-K order, so both files stay aligned with the records' spans.

    Replies recorded without rows (by a generator whose forward the hook did not see) first get spans after every
    existing one, in file order, rewriting the replies file once (atomically); rows no reply owns (a torn append)
    are cut before, so no new span can claim them."""
    width = engine.model.config.hidden_size
    path = reply_path(out, temperature)
    records = read_shard(path)
    topk_done = cut_to_replies(topk_path(out, temperature), records, topk_bytes())
    if not all(r.get("topk") for r in records):
        cut_to_replies(hidden_path(out, temperature), records, width * 2)
        end = rows_end(records)
        for r in records:
            if not r.get("topk"):
                r["topk"] = [end, len(r["reply_ids"]) + (not r["truncated"])]  # the end-of-turn position too
                end += r["topk"][1]
        write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    records.sort(key=lambda r: r["topk"][0])
    hidden_done = cut_to_replies(hidden_path(out, temperature), records, width * 2) if hidden else rows_end(records)
    done = min(topk_done, hidden_done)
    todo = [r for r in records if r["topk"][0] >= done]
    if todo and todo[0]["topk"][0] != done:
        raise ValueError(f"the rows of {out} for T={temperature:g} end at position {done}, inside a reply: a file "
                         "was changed by hand")
    tokenizer, base, head = engine.tokenizer, engine.model.base_model, engine.model.get_output_embeddings()
    bar = tqdm(total=len(todo), desc=f"teacher-forced rows T={temperature:g}", unit="reply", disable=not progress)
    encoded = {record["id"]: prompt_ids(tokenizer, prompts[record["id"]]) for record in todo}
    start = 0
    while start < len(todo):
        batch, longest = [], 0
        for record in todo[start:]:
            longest = max(longest, len(encoded[record["id"]]) + len(record["reply_ids"]))
            if batch and (len(batch) + 1) * longest ** 2 > HIDDEN_PAIR_BUDGET:
                break
            batch.append((record, encoded[record["id"]]))
        # right padding: every real position keeps its own index
        seqs = [ids + record["reply_ids"] for record, ids in batch]
        input_ids = pad_sequence([torch.tensor(q) for q in seqs], batch_first=True,
                                 padding_value=tokenizer.pad_token_id or 0)  # a tokenizer without a pad token too
        mask = pad_sequence([torch.ones(len(q), dtype=torch.long) for q in seqs], batch_first=True)
        device = engine.model.device
        states = base(input_ids=input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        hidden_rows, topk_rows = [], []
        for b, (record, ids) in enumerate(batch):
            first, count = record["topk"]
            rows = states[b, len(ids) - 1: len(ids) - 1 + count]
            if rows.shape[0] != count:
                raise RuntimeError(f"reply {record['id']}: {count} top-K rows but {rows.shape[0]} positions")
            if hidden and first >= hidden_done:
                hidden_rows.append(rows.to(torch.bfloat16).cpu())
            if first >= topk_done:
                topk_rows.append(pack_topk(head(rows)).cpu())
        if hidden_rows:
            append_bytes(hidden_path(out, temperature), torch.cat(hidden_rows).view(torch.uint8).numpy().tobytes())
        if topk_rows:
            append_bytes(topk_path(out, temperature), torch.cat(topk_rows).numpy().tobytes())
        on_batch()
        start += len(batch)
        bar.update(len(batch))
    bar.close()


# ------------------------------------------------------------------------------------------ command

def settings_of(args: argparse.Namespace) -> dict:
    """What the data depends on: a resumed run must match these (--magpie may grow, --prompts may be added)."""
    magpie = {"temperature": MAGPIE_TEMPERATURE, "top_p": MAGPIE_TOP_P, "max_tokens": MAGPIE_TOKENS,
              "batch_size": args.batch_size, "seed": args.seed}
    settings = {"target": str(args.target), "max_new_tokens": args.max_new_tokens, "magpie": magpie,
                "magpie_tasks": {**magpie, "max_tokens": None, "seed": args.seed + TASK_SEED,
                                 "tasks": [[t.name, t.system, t.tokens, t.instruction] for t in TASKS]}}
    if args.follow_ups:  # recorded once used, as styles are
        settings["follow_ups"] = {**magpie, "seed": args.seed + FOLLOW_UP_SEED, "first_turn_words": FOLLOW_UP_WORDS}
    if args.magpie_styles:  # recorded once used: a directory made before styles existed resumes as it was
        settings["magpie_styles"] = {**magpie, "max_tokens": [MAGPIE_TOKENS, STYLE_DOCUMENT_TOKENS],
                                     "seed": args.seed + STYLE_SEED, "exemplars": STYLE_EXEMPLARS,
                                     "words": STYLE_WORDS}
    return settings


def write_manifest(out: Path, settings: dict, dtype: torch.dtype, temperatures: list[float],
                   dropped_files: Counter, engine: Engine) -> dict:
    """Counts recomputed from the shards themselves (so they are right after any interruption)."""
    prompts = read_shard(out / "prompts.jsonl")
    def summary(lines: list[dict]) -> dict:
        return {"samples": sum(line["samples"] for line in lines), "kept": sum(line["kept"] for line in lines),
                "dropped": dict(sum((Counter(line["dropped"]) for line in lines), Counter()))}

    replies = {}
    for t in sorted({*temperatures, *(float(p.stem.split("-T", 1)[1]) for p in out.glob("replies-T*.jsonl"))}):
        rows = read_shard(reply_path(out, t))
        replies[f"{t:g}"] = {"replies": len(rows), "tokens": sum(len(r["reply_ids"]) for r in rows),
                             "truncated": sum(r["truncated"] for r in rows),
                             "empty": sum(not r["conversations"][1]["value"] for r in rows)}
        if hidden_path(out, t).exists():  # positions with a cached hidden state (of hidden_size bf16 values)
            replies[f"{t:g}"]["hidden_bytes"] = hidden_path(out, t).stat().st_size
    manifest = {"settings": settings, "dtype": str(dtype).removeprefix("torch."),
                "prompts": {"total": len(prompts), "by_source": dict(Counter(p["source"] for p in prompts)),
                            "dropped_from_files": dict(dropped_files)},
                "magpie": summary(read_shard(out / "magpie.jsonl")),
                "magpie_tasks": summary(read_shard(out / "magpie-tasks.jsonl"))
                | {"by_task": dict(Counter(p["task"] for p in prompts if p["source"] == "magpie_task"))},
                "magpie_styles": summary(read_shard(out / "magpie-styles.jsonl"))
                | {"by_style": dict(Counter(p["task"] for p in prompts if p["source"] == "magpie_style"))},
                "follow_ups": summary(read_shard(out / "follow-ups.jsonl"))
                | {"later_turns": sum("history" in p for p in prompts)},
                "replies": replies,
                "last_run": {"tokens_per_s": round(engine.tokens / engine.seconds, 1) if engine.seconds else None}}
    write_json(out / "manifest.json", manifest)
    return manifest


def make_data(args: argparse.Namespace, generate: Generate | None = None, progress: bool = True) -> dict:
    temperatures = parse_temperatures(args.temperatures)
    out = Path(args.out)
    settings = settings_of(args)
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        previous = json.loads(manifest_path.read_text())["settings"]
        # a key the previous run did not record is a prompt source added since (nothing was made with it)
        changed = sorted(k for k in settings if k in previous and previous[k] != settings[k])
        if changed:
            raise ValueError(f"{out} was made with other settings ({', '.join(changed)} differ); resume with the "
                             "same ones or choose a new --out")
    for path in args.prompts:
        if not Path(path).is_file():
            raise FileNotFoundError(f"prompt file not found: {path}")
    magpie = args.magpie or args.magpie_tasks or args.magpie_styles
    if not magpie and not args.prompts and not (out / "prompts.jsonl").exists():
        raise ValueError("nothing to answer: give --magpie N, --magpie-tasks N, --magpie-styles N and/or "
                         "--prompts FILE")

    tokenizer = target_tokenizer(args.target)
    if magpie:
        magpie_prefix(tokenizer)  # refuses a template-less target before the model loads
    dtype = resolve_dtype(args.dtype, args.device)
    engine = Engine(load_target(args.target, args.device, dtype), tokenizer, generate or hf_sample)
    out.mkdir(parents=True, exist_ok=True)  # only once the target loaded: a bad target leaves nothing behind

    prompts_path = out / "prompts.jsonl"
    seen = {normalize(p["prompt"]) for p in read_shard(prompts_path)}
    new, dropped_files = file_prompts(args.prompts, seen)
    append_shard(prompts_path, new)

    manifest = functools.partial(write_manifest, out, settings, dtype, temperatures, dropped_files, engine)
    manifest()
    fill_rows(engine, out, temperatures, args.hidden, progress, manifest)
    step = ROUND_BATCHES * args.batch_size  # Magpie in rounds, each answered before the next
    evens = [q for q in read_spec_bench() if not is_heldout(q)]
    styles = style_tasks(evens, -(-args.magpie_styles // args.batch_size), args.seed + STYLE_SEED)
    kinds = ((args.magpie, PLAIN_KIND, (PLAIN,)), (args.magpie_tasks, TASK_KIND, TASKS),
             (args.magpie_styles, STYLE_KIND, styles))
    for round_ in range(1, max(1, -(-max(count for count, _, _ in kinds) // step)) + 1):
        for count, kind, tasks in kinds:
            if count:
                magpie_batches(engine, out, min(count, round_ * step), args.batch_size, args.seed, seen, prompts_path,
                               progress, manifest, kind, tasks)
        while True:  # the replies, then those to the later turns they open (each first turn opens at most one)
            reply_batches(engine, out, read_shard(prompts_path), temperatures, args.max_new_tokens, args.batch_size,
                          args.seed, progress, manifest, args.hidden)
            if not follow_ups(engine, out, temperatures, min(args.follow_ups, round_ * step), args.batch_size,
                              args.seed, prompts_path, progress, manifest):
                break
    fill_rows(engine, out, temperatures, args.hidden, progress, manifest)
    return manifest()


def fill_rows(engine: Engine, out: Path, temperatures: list[float], hidden: bool, progress: bool,
              on_batch: Callable[[], None]) -> None:
    prompts = {p["id"]: prompt_messages(p) for p in read_shard(out / "prompts.jsonl")}
    for t in temperatures:
        teacher_forced(engine, out, prompts, t, hidden, progress, on_batch)


def parse_temperatures(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--temperatures must be comma-separated numbers, e.g. 0,0.7; got {text!r}") from None
    if not values or any(not (0 <= v < 10) for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--temperatures must be distinct numbers in [0, 10), e.g. 0,0.7; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="chat target: HF dir, hub id, .gguf file or 'smollm2'")
    parser.add_argument("--out", required=True, help="output directory (append-only; rerun to resume or extend)")
    parser.add_argument("--magpie", type=int, default=0, help="prompts the target writes itself (samples drawn)")
    parser.add_argument("--magpie-tasks", type=int, default=0,
                        help="more such samples, each batch steered to one kind of task by a system turn (math, "
                        "code, writing, translation, texts to summarize, ...: training.make_data.TASKS)")
    parser.add_argument("--magpie-styles", type=int, default=0,
                        help="more samples, each batch steered by real questions: even-id Spec-Bench questions of one "
                        "category quoted as examples (writing, roleplay, reasoning, math, coding, extraction, STEM, "
                        "humanities, translation, summarization, QA, RAG); odd ids are never shown")
    parser.add_argument("--follow-ups", type=int, default=0,
                        help="second turns the target writes after its own reply to that many of its first turns "
                        "(multi-turn chats; a Spec-Bench question's own second turn is always asked)")
    parser.add_argument("--prompts", nargs="*", default=[],
                        help="prompt files: ShareGPT JSON/JSONL, {'prompt'} / {'messages'} JSONL, Spec-Bench "
                        "(odd ids are held out and skipped)")
    parser.add_argument("--temperatures", default="0,0.7", help="reply temperatures (0 = greedy), default 0,0.7")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="reply length cap")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", action="store_true",
                        help="also cache the target's final hidden state at every reply position (hidden_size bf16 "
                        "values per position, from the generating forward; replies made before get one teacher-forced "
                        "forward): what a target-aware drafter reads, and feature-loss targets")
    add_device_arguments(parser)


def run(args: argparse.Namespace) -> int:
    check_arguments(args, (("max_new_tokens", 1), ("batch_size", 1), ("magpie", 0), ("magpie_tasks", 0),
                           ("magpie_styles", 0), ("follow_ups", 0)))
    check_device(args.device)
    manifest = make_data(args)
    replies = ", ".join(f"T={t}: {r['replies']} replies, {r['tokens']} tokens" for t, r in manifest["replies"].items())
    magpie = {k: sum(manifest[part][k] for part in ("magpie", "magpie_tasks", "magpie_styles"))
              for k in ("kept", "samples")}
    print(f"make-data: {manifest['prompts']['total']} prompts ({magpie['kept']} of {magpie['samples']} Magpie "
          f"samples kept); {replies}; {args.out}/manifest.json")
    return 0
