"""Data: packed pretraining sequences and assistant-masked SFT conversations, as resumable per-rank iterators.

Both iterators are infinite (they loop over epochs, reshuffled from `seed + epoch`), shard documents across ranks
(nothing dropped), and expose `state_dict()` / `load_state_dict()` so a resumed run sees the exact batch it would have.
"""
from __future__ import annotations

import glob
import itertools
from collections import Counter
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import datasets
import torch
from datasets.distributed import split_dataset_by_node
from transformers import PreTrainedTokenizerBase

from training.chat import FALLBACK_CHAT_TEMPLATE, normalize_conversation
from training.config import DataConfig

IGNORE_INDEX = -100
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


# ---------------------------------------------------------------------------------------------- loading

def draft_label_map(draft_ids: torch.Tensor, vocab: int, device) -> torch.Tensor:
    """target id -> draft column, IGNORE_INDEX for ids outside the draft vocabulary (ids below `vocab` and any id
    of `draft_ids` are mapped)."""
    to_draft = torch.full((max(vocab, int(draft_ids.max()) + 1),), IGNORE_INDEX, dtype=torch.long)
    to_draft[draft_ids.cpu()] = torch.arange(draft_ids.numel())
    return to_draft.to(device)


def is_local(path: str) -> bool:
    return (path.startswith((".", "/", "~")) or Path(path).suffix in LOCAL_BUILDERS
            or any(c in path for c in "*?[") or Path(path).exists())


def load_records(cfg: DataConfig) -> datasets.Dataset | datasets.IterableDataset:
    """Local json/jsonl/parquet file(s) (glob allowed) or a hub dataset (`path` + `hub_config`, optionally streamed)."""
    if not cfg.path:
        raise ValueError("data.path is empty: give a local json/jsonl/parquet file or a hub dataset id")
    if not is_local(cfg.path):
        return datasets.load_dataset(cfg.path, name=cfg.hub_config, split=cfg.split, streaming=cfg.streaming)
    files = sorted(glob.glob(str(Path(cfg.path).expanduser())))
    if not files:
        raise FileNotFoundError(f"data.path {cfg.path!r} matches no file")
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) != 1 or suffixes.pop() not in LOCAL_BUILDERS:
        raise ValueError(f"data.path {cfg.path!r}: expected .json, .jsonl or .parquet files, got {files[:3]}")
    builder = LOCAL_BUILDERS[Path(files[0]).suffix]
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=cfg.streaming)


def require_columns(ds, wanted: list[str], what: str) -> None:
    columns = ds.column_names or list(next(iter(ds)).keys())
    if not any(c in columns for c in wanted):
        raise ValueError(f"{what} data needs a column named {' or '.join(map(repr, wanted))}; "
                         f"the dataset has columns {columns}")


def rank_order(n: int, seed: int, epoch: int, rank: int, world: int) -> list[int]:
    """This rank's record indices for one epoch: a seeded permutation, then every world-th record."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))[rank::world].tolist()


@dataclass
class EpochCursor:
    """A resumable position in the per-rank, epoch-shuffled `examples` of a subclass (which also holds `seed`,
    `rank` and `world`); its checkpointed state is the fields named in STATE."""
    STATE = ("epoch", "pos")
    _: KW_ONLY
    epoch: int = 0
    pos: int = 0
    _order: tuple[int, list[int]] | None = field(default=None, repr=False)  # (epoch, indices) cache

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.STATE}

    def load_state_dict(self, state: dict) -> None:
        for name in self.STATE:
            setattr(self, name, state[name])

    def order(self) -> list[int]:
        """This epoch's `rank_order` of the examples."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, rank_order(len(self.examples), self.seed, self.epoch, self.rank, self.world))
        if not self._order[1]:
            raise ValueError(f"rank {self.rank} received no examples: fewer examples than ranks")
        return self._order[1]


# ------------------------------------------------------------------------------------------- pretraining

class PackedSequences:
    """Tokenize documents on the fly, append EOS to each, concatenate and cut into `seq_len` windows."""

    def __init__(self, docs, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, rank: int, world: int):
        require_columns(docs, [cfg.text_column], "pretraining")
        self.docs, self.tokenizer, self.cfg, self.rank, self.world = docs, tokenizer, cfg, rank, world
        self.load_state_dict({"epoch": 0, "doc_pos": 0, "buffer": []})

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "doc_pos": self.doc_pos, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.doc_pos, self.buffer = state["epoch"], state["doc_pos"], list(state["buffer"])
        self._docs_iter = None

    def _epoch_docs(self):
        if isinstance(self.docs, datasets.IterableDataset):
            ds = self.docs.shuffle(seed=self.cfg.seed, buffer_size=self.cfg.shuffle_buffer)
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world)
            ds.set_epoch(self.epoch)
            # islice, not ds.skip(): skip() changes how a shuffled stream orders its shards and buffer
            yield from (row[self.cfg.text_column] for row in itertools.islice(ds, self.doc_pos, None))
        else:
            order = rank_order(len(self.docs), self.cfg.seed, self.epoch, self.rank, self.world)
            yield from (self.docs[i][self.cfg.text_column] for i in order[self.doc_pos:])

    def _next_doc(self) -> str:
        for _ in range(2):  # at most one epoch boundary per call; an empty shard is an error
            if self._docs_iter is None:
                self._docs_iter = self._epoch_docs()
            doc = next(self._docs_iter, None)
            if doc is not None:
                self.doc_pos += 1
                return doc
            self.epoch, self.doc_pos, self._docs_iter = self.epoch + 1, 0, None
        raise ValueError(f"rank {self.rank} received no documents: the dataset has fewer documents than ranks")

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        eos = self.tokenizer.eos_token_id
        while len(self.buffer) < self.cfg.seq_len:
            self.buffer += self.tokenizer(self._next_doc(), add_special_tokens=False)["input_ids"] + [eos]
        window, self.buffer = self.buffer[:self.cfg.seq_len], self.buffer[self.cfg.seq_len:]
        return torch.tensor(window, dtype=torch.long)

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        input_ids = torch.stack([next(self) for _ in range(batch_size)])
        return {"input_ids": input_ids, "labels": input_ids.clone()}


# ------------------------------------------------------------------------------------------------- SFT

def render_sft(messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_len: int) -> tuple[list[int], list[int], str]:
    """Chat-template text -> (input_ids, labels with IGNORE_INDEX outside assistant replies, skip reason)."""
    template = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                             add_generation_prompt=gen)
    text = render(messages, False)
    spans = []  # character spans of assistant replies (including the template's end-of-turn tokens)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            upto = render(messages[:i + 1], False)
            if not text.startswith(upto):
                return [], [], "template_not_prefix_stable"
            spans.append((len(render(messages[:i], True)), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_len)
    labels = [tok if any(s <= a < e for s, e in spans) else IGNORE_INDEX
              for tok, (a, _) in zip(enc["input_ids"], enc["offset_mapping"])]
    if all(label == IGNORE_INDEX for label in labels):
        return [], [], "no_assistant_tokens_after_truncation"
    return enc["input_ids"], labels, ""


def prepare_sft(records: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_len: int,
                evaluation: bool = False) -> tuple[datasets.Dataset, Counter]:
    """Render every conversation; return the usable ones and a count of skipped records by reason (held-out
    questions among them unless `evaluation`, see normalize_conversation)."""
    if isinstance(records, datasets.IterableDataset):
        raise ValueError("SFT data must be a finite dataset: set data.streaming=false")
    require_columns(records, ["conversations", "messages"], "SFT")

    def process(record):
        messages, reason = normalize_conversation(record, evaluation)
        ids, labels, reason = render_sft(messages, tokenizer, max_len) if messages is not None else ([], [], reason)
        return {"input_ids": ids, "labels": labels, "skip": reason}

    processed = records.map(process, remove_columns=records.column_names, keep_in_memory=True,
                            desc="rendering conversations")
    skipped = Counter(r for r in processed["skip"] if r)
    kept = processed.filter(lambda r: not r["skip"], keep_in_memory=True).remove_columns("skip")
    if len(kept) == 0:
        raise ValueError(f"all {len(processed)} SFT records were skipped as malformed: {dict(skipped)}")
    return kept, skipped


@dataclass
class SFTExamples(EpochCursor):
    """Per-rank, epoch-shuffled, padded micro-batches of rendered conversations."""
    examples: datasets.Dataset
    pad_id: int
    seed: int
    rank: int
    world: int

    def _next_index(self) -> int:
        if self.pos >= len(self.order()):
            self.epoch, self.pos = self.epoch + 1, 0
        self.pos += 1
        return self.order()[self.pos - 1]

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        rows = [self.examples[self._next_index()] for _ in range(batch_size)]
        width = max(len(r["input_ids"]) for r in rows)
        pad = lambda seq, value: seq + [value] * (width - len(seq))  # right padding: causal, never seen
        return {"input_ids": torch.tensor([pad(r["input_ids"], self.pad_id) for r in rows]),
                "labels": torch.tensor([pad(r["labels"], IGNORE_INDEX) for r in rows]),
                "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows])}
