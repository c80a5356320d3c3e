"""The Python entry point: a target and a drafter by name, text or chat messages in, text out.

    from tree_search import SpeculativeGenerator
    generator = SpeculativeGenerator("smollm2", drafter="smollm2")
    print(generator.generate("What is a state-space model?", max_new_tokens=64).text)

Names are what `mamba-draft generate` takes, or already-loaded models; defaults are the command's (`run_defaults`).
A prompt is a string (through the chat template) or a list of chat messages; a list of prompts is a batch.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mamba_draft.devices import check_device, resolve_dtype
from mamba_draft.targets import default_attention
from tree_search.calls import GenerateStats
from tree_search.generate import SpeculativeDecoder
from tree_search.prompts import encode_prompt

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class RunDefaults:
    """What a run uses when the caller names nothing else."""

    device: str
    dtype: torch.dtype
    attention: str
    tree: str  # a policy spec (`tree_search.policy`)


def run_defaults(device: str | None = None, dtype: str | torch.dtype = "auto", target=None) -> RunDefaults:
    """The defaults of `mamba-draft generate` and `SpeculativeGenerator`: CUDA when available, else the CPU; the
    device's dtype (`resolve_dtype`; for a named `target`, `targets.auto_dtype`: fp32 for a Llama-family GGUF on a
    CPU) and the attention that keeps speculative output equal to plain decoding in it (`default_attention`); the
    device's own tree policy ("auto")."""
    from mamba_draft.targets import auto_dtype

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    dtype = auto_dtype(target, device) if dtype == "auto" and target is not None else resolve_dtype(dtype, device)
    return RunDefaults(device, dtype, default_attention(dtype, device), "auto")


def check_model_name(name, what: str) -> None:
    """Refuse a model name that cannot load, before anything loads: a local path must exist (a directory, or a
    .gguf file for a target); `smollm2` needs its wheel; any other name is left to the hub."""
    from mamba_draft.targets import SHIPPED_TARGET, resolve_gguf

    text = str(name)
    local = Path(text).expanduser()
    if text != SHIPPED_TARGET and (text.startswith((".", "/", "~")) or isinstance(name, os.PathLike)) \
            and not local.exists():
        raise ValueError(f"{what} {text} does not exist: give an HF model directory, a hub id, a .gguf file or "
                         "'smollm2'")
    if what == "drafter" and local.exists() and not local.is_dir():
        raise ValueError(f"drafter {text} is not a directory: give a drafter checkpoint directory, a hub id or "
                         "'smollm2'")
    if what == "target":
        try:
            resolve_gguf(text)
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"target {text}: {err}") from None


@dataclass
class TextResult:
    text: str  # the new tokens, decoded without special tokens
    token_ids: list[int]  # the new tokens
    stats: GenerateStats


class SpeculativeGenerator:
    """A target and a drafter (names or loaded models) with their tokenizer and the engine (`SpeculativeDecoder`);
    drafter None decodes plainly. device / dtype: `run_defaults` unless given (a loaded target keeps its own);
    products: the target's products on a CPU (`targets.integer_products`: auto, float or int8); options: the engine's
    (`generate.EngineOptions`' fields but integer_products; tree None: `run_defaults`' tree).
    """

    def __init__(self, target, drafter=None, *, tokenizer=None, device: str | None = None,
                 dtype: str | torch.dtype = "auto", products: str = "auto", **options) -> None:
        from mamba_draft import load_drafter
        from mamba_draft.targets import integer_products, load_causal_lm, load_tokenizer

        named = isinstance(target, (str, os.PathLike))
        name = str(target) if named else None
        if named:
            check_model_name(target, "target")
        elif tokenizer is None:
            raise ValueError("an already-loaded target needs its tokenizer: pass tokenizer=")
        if isinstance(drafter, (str, os.PathLike)):
            check_model_name(drafter, "drafter")
        defaults = run_defaults(device, dtype, target if named else None)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target)
        if named:
            target = load_causal_lm(target, dtype=defaults.dtype, device=defaults.device)
        if isinstance(drafter, (str, os.PathLike)):
            drafter = load_drafter(drafter, target=target)  # refuses a drafter made for another target
        self.target, self.drafter, self.defaults = target, drafter, defaults
        if options.get("tree") is None:
            options["tree"] = defaults.tree
        self.decoder = SpeculativeDecoder(target, drafter, tokenizer=self.tokenizer,
                                          integer_products=integer_products(products, target, name), **options)

    def encode(self, prompt, system_prompt: str | None = None, chat_template: bool = True) -> list[int]:
        """Token ids of one prompt: a string (`encode_prompt`) or a list of {"role", "content"} messages."""
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, use_chat_template=chat_template, system_prompt=system_prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise ValueError('a prompt is a string or a list of chat messages like [{"role": "user", "content": "..."}]')
        for i, message in enumerate(prompt):
            if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
                raise ValueError(f'message {i} must be {{"role": one of {", ".join(ROLES)}, "content": a string}}, '
                                 f"got {message!r}")
        if system_prompt is not None:
            raise ValueError("system_prompt goes with a string prompt; put a system message in the messages instead")
        if not chat_template or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat messages need the tokenizer's chat template; pass a string prompt instead")
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def generate(self, prompt, *, max_new_tokens: int = 128, system_prompt: str | None = None,
                 chat_template: bool = True, **options) -> TextResult | list[TextResult]:
        """One prompt -> TextResult; a list of prompts (strings or message lists) -> one TextResult each, decoded
        as a batch. options: as `tree_search.generate` takes them."""
        batch = isinstance(prompt, (list, tuple)) and bool(prompt) and not isinstance(prompt[0], dict)
        prompts = list(prompt) if batch else [prompt]
        ids = [self.encode(p, system_prompt, chat_template) for p in prompts]
        result = self.decoder.generate(ids if batch else torch.tensor([ids[0]]), max_new_tokens=max_new_tokens,
                                       **options)
        rows = result.rows if batch else [result]
        texts = [TextResult(self.tokenizer.decode(row.new_tokens[0], skip_special_tokens=True),
                            row.new_tokens[0].tolist(), row.stats) for row in rows]
        return texts if batch else texts[0]

    def stream(self, prompt, **options) -> Iterator[str]:
        """`generate` for one prompt, yielding its text as rounds commit (transformers' TextIteratorStreamer)."""
        from transformers import TextIteratorStreamer

        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], dict):
            raise ValueError("stream takes one prompt; generate decodes a list of prompts as a batch")
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure = []

        def work():
            try:
                self.generate(prompt, streamer=streamer, **options)
            except BaseException as err:  # re-raised in the caller's thread once the stream ends
                failure.append(err)
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        yield from streamer
        thread.join()
        if failure:
            raise failure[0]
