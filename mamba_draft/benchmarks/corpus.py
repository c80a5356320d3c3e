"""Demo corpus from text every machine has: the Python standard library's own source, split by file.

Also trains the demo's byte-level BPE tokenizer locally and cuts held-out completion prompts.
"""
from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Generated tables and data dumps: long, repetitive, not code a model should learn from.
SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__", "turtledemo"}
SKIP_PREFIXES = ("_sysconfigdata",)
SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "unk_token": "<|unk|>"}


@dataclass
class CorpusConfig:
    root: str | None = None          # directory of .py files; None = this interpreter's standard library
    heldout_fraction: float = 0.1
    max_train_chars: int = 4_000_000
    max_heldout_chars: int = 400_000
    vocab_size: int = 2048
    n_prompts: int = 16
    prompt_chars: int = 400
    chunk_lines: int = 40            # training documents: files cut at blank lines into ~this many lines


def source_files(root: Path) -> list[Path]:
    """Sorted .py files under `root`, skipping tests and generated tables."""
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root is not a directory: {root}")
    files = [p for p in root.rglob("*.py")
             if not SKIP_PARTS.intersection(p.relative_to(root).parts[:-1]) and not p.name.startswith(SKIP_PREFIXES)]
    if not files:
        raise ValueError(f"no .py files under {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    """Stable split by file: the same file lands on the same side on every machine and Python version."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def read_texts(files: list[Path], max_chars: int) -> list[str]:
    """File contents (undecodable files skipped) until `max_chars` characters are collected."""
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text[: max_chars - total])
            total += len(texts[-1])
            if total >= max_chars:
                break
    return texts


def split_corpus(cfg: CorpusConfig) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts), split by file."""
    root = Path(cfg.root or sysconfig.get_paths()["stdlib"])
    files = source_files(root)
    heldout = [p for p in files if is_heldout(p.relative_to(root).as_posix(), cfg.heldout_fraction)]
    train = [p for p in files if not is_heldout(p.relative_to(root).as_posix(), cfg.heldout_fraction)]
    if not train or not heldout:
        raise ValueError(f"split of {len(files)} files left an empty side; change heldout_fraction")
    return read_texts(train, cfg.max_train_chars), read_texts(heldout, cfg.max_heldout_chars)


def chunk_source(text: str, lines_per_chunk: int) -> list[str]:
    """Cut a file at blank lines into pieces of about `lines_per_chunk` lines, trailing newlines stripped.

    Packed pretraining appends EOS to every document; short documents mix many files into each batch, and
    stripping the final newline keeps EOS from becoming a likely token after every line break.
    """
    groups, current = [], []
    for block in re.split(r"\n\s*\n", text):
        current.append(block)
        if sum(b.count("\n") + 1 for b in current) >= lines_per_chunk:
            groups.append(current)
            current = []
    chunks = ("\n\n".join(group).strip("\n") for group in groups + [current])  # an empty last group: ""
    return [c for c in chunks if c.strip()]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts`, wrapped as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


_DEF = re.compile(r"^[ \t]*(async\s+def|def|class)\s+\w+.*:[ \t]*$", re.MULTILINE)


def completion_prompts(texts: list[str], n: int, prompt_chars: int) -> list[dict]:
    """Code-completion prompts: the source up to the colon ending a `def`/`class` header line.

    The prompt ends before the header's newline: byte-level BPE encodes "newline + indentation" as one token,
    so a prompt ending in a bare newline would force a tokenization the model never saw in training.

    Taken round-robin over files so prompts come from many files; each is cut to start at a line boundary,
    at most `prompt_chars` characters before the header's end. Category = "def" or "class".
    """
    per_file = [[m for m in _DEF.finditer(t) if m.start() >= prompt_chars // 2] for t in texts]
    prompts, depth = [], 0
    while len(prompts) < n and any(len(ms) > depth for ms in per_file):
        for text, matches in zip(texts, per_file):
            if depth < len(matches) and len(prompts) < n:
                m = matches[depth * 7 % len(matches)] if depth else matches[len(matches) // 2]
                end = m.end()
                start = text.find("\n", max(0, end - prompt_chars)) + 1
                prompts.append({"prompt": text[start:end], "category": "class" if m.group(1) == "class" else "def"})
        depth += 1
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} completion prompts could be cut from the held-out files, {n} requested")
    return prompts


def build_corpus(out_dir: str | Path, cfg: CorpusConfig) -> dict[str, Path]:
    """Write train.jsonl / heldout.jsonl ({"text": chunk}), prompts.jsonl and tokenizer/ under `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = split_corpus(cfg)
    paths = {"train": out_dir / "train.jsonl", "heldout": out_dir / "heldout.jsonl",
             "prompts": out_dir / "prompts.jsonl", "tokenizer": out_dir / "tokenizer"}
    for key, texts in (("train", train), ("heldout", heldout)):
        docs = [chunk for text in texts for chunk in chunk_source(text, cfg.chunk_lines)]
        paths[key].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prompts = completion_prompts(heldout, cfg.n_prompts, cfg.prompt_chars)
    paths["prompts"].write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    train_tokenizer(train, cfg.vocab_size).save_pretrained(paths["tokenizer"])
    return paths
