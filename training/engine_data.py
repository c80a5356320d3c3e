"""Distillation data from the data engine (`mamba-draft make-data`): packed token windows with the target's cached
top-K next-token distribution at every reply position, so distillation needs no target forward.

    data: {kind: engine, path: DIR, seq_len: 512}        # DIR: a make-data output directory, or a directory of
                                                         # them (data made in several runs or on several machines)

Each reply becomes the target's chat-template prompt ids + its reply ids (+ the end-of-turn id unless cut), scored
on the reply; replies are shuffled per epoch (seeded), concatenated and cut into `seq_len` windows, like packed
pretraining. The iterator is infinite and resumable (`state_dict`). Held-out questions are skipped.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from mamba_draft.heldout import is_heldout_text
from training.data import IGNORE_INDEX, EpochCursor
from training.make_data import (
    hidden_path, prompt_messages, read_hidden, read_shard, read_topk, topk_bytes, topk_path,
)
from training.regenerate import prompt_ids


@dataclass
class EngineExample:
    input_ids: torch.Tensor   # (L,) long
    labels: torch.Tensor      # (L,) long, IGNORE_INDEX outside the reply
    soft_ids: torch.Tensor    # (L, K) int32: the target's top-K ids for predicting token t (rows outside: 0)
    soft_logp: torch.Tensor   # (L, K) float16: their log-probabilities (rows outside: 0, never read)
    hidden: torch.Tensor | None = None  # (L, d) bfloat16: the target's final hidden state each row's distribution
                                        # came from (make-data --hidden; rows outside: 0, never read)


HELDOUT = 64  # one prompt in HELDOUT (by a stable hash of its id) is held out of training for agreement curves
SPLITS = ("train", "heldout", "all")


def heldout_ids(prompt_ids) -> set[str]:
    """The prompts held out of training: one in HELDOUT by a stable hash of the id (at least one: the lowest)."""
    ids = list(prompt_ids)
    held = {i for i in ids if zlib.crc32(i.encode()) % HELDOUT == 0}
    return held or ({min(ids, key=lambda i: (zlib.crc32(i.encode()), i))} if ids else set())


def first_turn(prompt_id: str) -> str:
    """The id of a chat's first prompt (a later turn's id is `{first}/{turn}`): a chat is on one side of the split."""
    return prompt_id.split("/", 1)[0]


def engine_dirs(directory: str | Path) -> list[Path]:
    """The make-data directories `directory` names: itself, or else those directly inside it (sorted by name)."""
    directory = Path(directory).expanduser()
    if (directory / "prompts.jsonl").is_file() or not directory.is_dir():
        return [directory]
    found = sorted(d for d in directory.iterdir() if (d / "prompts.jsonl").is_file())
    if not found:
        raise FileNotFoundError(f"{directory} is neither a make-data directory nor holds any")
    return found


def load_engine(directory: str | Path, tokenizer, temperatures: list[float] | None = None,
                split: str = "all", hidden_size: int | None = None) -> list[EngineExample]:
    """The replies of a make-data directory, or of every one inside `directory` (the given temperatures, else all;
    of its `split`) as EngineExamples; every reply of a chat is on the same side of the split. `hidden_size`:
    also read the cached hidden states (make-data --hidden), of that width."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if hidden_size:
        check_hidden_width(directory, hidden_size, temperatures=temperatures)
    examples = []
    for part in engine_dirs(directory):
        prompts = {p["id"]: prompt_messages(p) for p in read_shard(part / "prompts.jsonl")}
        held = heldout_ids({first_turn(i) for i in prompts})
        for path, temperature in reply_files(part, temperatures):
            for record in read_shard(path):
                chat = prompts.get(record["id"])
                if chat is None or not record.get("topk") or not record["reply_ids"] or any(
                        m["role"] == "user" and is_heldout_text(m["content"]) for m in chat):
                    continue
                if split != "all" and ("heldout" if first_turn(record["id"]) in held else "train") != split:
                    continue
                prompt = prompt_ids(tokenizer, chat)
                reply = record["reply_ids"] + ([] if record["truncated"] else [tokenizer.eos_token_id])
                ids, logp = read_topk(part, temperature, record)
                # row t: the distribution token t was drawn from (and its state); prompt rows: 0
                rows = lambda x: torch.cat([x.new_zeros(len(prompt), *x.shape[1:]), x])
                hidden = rows(read_hidden(part, temperature, record, hidden_size)) if hidden_size else None
                labels = torch.tensor([IGNORE_INDEX] * len(prompt) + reply)
                examples.append(EngineExample(torch.tensor(prompt + reply), labels, rows(ids.to(torch.int32)),
                                              rows(logp.to(torch.float16)), hidden))
    if not examples:
        raise ValueError(f"{directory}: no usable replies (with cached top-K) at temperatures {temperatures}")
    return examples


def reply_files(directory: Path, temperatures: list[float] | None = None) -> list[tuple[Path, float]]:
    """The replies-T*.jsonl files of a make-data directory with their temperatures (those given, else all)."""
    files = sorted(directory.glob("replies-T*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no replies-T*.jsonl (not a make-data directory?)")
    found = [(path, float(path.stem.split("-T", 1)[1])) for path in files]
    return [(path, t) for path, t in found if temperatures is None or t in temperatures]


def check_hidden_width(directory: str | Path, width: int, name: str = "the drafter's width",
                       temperatures: list[float] | None = None) -> None:
    """Each make-data directory's hidden-state files (at `temperatures`, else all) must cover every top-K position,
    `width` values each (`name`: what asks for it): a cheap check before anything is read."""
    for part, temperature in [(part, t) for part in engine_dirs(directory) for _, t in reply_files(part, temperatures)]:
        path = hidden_path(part, temperature)
        if not path.exists():
            raise ValueError(f"{part}: no cached hidden states for T={temperature:g} (a feature loss, or a drafter "
                             "that reads the target, needs them): run make-data again with --hidden")
        positions = topk_path(part, temperature).stat().st_size // topk_bytes()
        size = path.stat().st_size
        if size != positions * width * 2:
            held = f" (states {size // (2 * positions)} wide?)" if positions and size % (2 * positions) == 0 else ""
            raise ValueError(f"{path} holds {size} bytes{held}, not {positions} positions x {width} bf16 values "
                             f"({name}): unfinished (rerun make-data --hidden) or made by a target of another width")


@dataclass
class PackedEngine(EpochCursor):
    """Per-rank, epoch-shuffled replies packed into `seq_len` windows; infinite and resumable."""
    STATE = ("epoch", "pos", "offset")
    examples: list[EngineExample]
    seq_len: int
    seed: int
    rank: int
    world: int
    offset: int = 0  # tokens of the example at `pos` (the next of this epoch's order) already handed out

    def _window(self) -> list[tuple[EngineExample, int, int]]:
        """Pieces (example, start, stop) filling one window, advancing the position."""
        pieces, need = [], self.seq_len
        while need:
            example = self.examples[self.order()[self.pos]]
            take = min(need, example.input_ids.numel() - self.offset)
            pieces.append((example, self.offset, self.offset + take))
            need -= take
            self.offset += take
            if self.offset == example.input_ids.numel():
                self.pos, self.offset = self.pos + 1, 0
                if self.pos == len(self.order()):
                    self.epoch, self.pos = self.epoch + 1, 0
        return pieces

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        windows = [self._window() for _ in range(batch_size)]

        def stack(name: str) -> torch.Tensor:
            return torch.stack([torch.cat([getattr(e, name)[a:b] for e, a, b in w]) for w in windows])

        # a window that starts inside a reply: its first position has no prediction of its own (shift drops it)
        batch = {"input_ids": stack("input_ids"), "labels": stack("labels"), "soft_ids": stack("soft_ids").long(),
                 "soft_logp": stack("soft_logp").float()}
        if self.examples[0].hidden is not None:
            batch["hidden"] = stack("hidden").float()
        return batch
