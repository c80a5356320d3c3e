"""Build the model being trained (HF Mamba-1 / Mamba-2 drafter or a small Llama target) and its tokenizer."""
from __future__ import annotations

import math

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from training.config import ModelConfig


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    if not name_or_path:
        raise ValueError("model.tokenizer is empty: name the target's tokenizer (hub id or local path)")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no eos token; packing and chat rendering need one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padded positions carry label -100, so the id is irrelevant
    return tokenizer


def model_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> transformers.PretrainedConfig:
    """HF config for a model trained from scratch; vocab defaults to the tokenizer's, padded to a multiple."""
    vocab = cfg.vocab_size or math.ceil(len(tokenizer) / cfg.pad_vocab_multiple) * cfg.pad_vocab_multiple
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.arch == "mamba1":
        return transformers.MambaConfig(
            vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
            state_size=cfg.state_size, expand=cfg.expand, conv_kernel=cfg.conv_kernel,
            use_bias=False, use_conv_bias=True, **special)  # use_bias False = mamba_ssm layout
    if cfg.arch == "mamba2":
        inner = cfg.expand * cfg.hidden_size
        return transformers.Mamba2Config(
            vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
            state_size=cfg.state_size, expand=cfg.expand, conv_kernel=cfg.conv_kernel,
            head_dim=cfg.head_dim, num_heads=cfg.num_heads or inner // cfg.head_dim, n_groups=cfg.n_groups,
            use_bias=False, use_conv_bias=True, **special)
    if cfg.arch == "llama":
        heads = cfg.num_heads or max(1, cfg.hidden_size // 64)
        return transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=heads, num_key_value_heads=cfg.num_key_value_heads or heads,
            intermediate_size=cfg.intermediate_size or 4 * cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings, **special)
    raise ValueError(f"model.arch must be mamba1, mamba2 or llama, got {cfg.arch!r}")


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> torch.nn.Module:
    """A fresh model (seeded init) or `init_from` weights; fails if the tokenizer does not fit the vocabulary."""
    if cfg.init_from:
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(cfg, tokenizer), dtype=torch.float32)
    check_vocab(model.config, tokenizer, cfg.init_from or "model")
    return model


def check_vocab(config: transformers.PretrainedConfig, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but {name} vocab_size is {config.vocab_size}: "
                         "token ids would index past the embedding table; use the model's own tokenizer "
                         "or a larger model.vocab_size")


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay on norms, biases and the SSM's A_log / D (as mamba_ssm marks them)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or name.endswith(("A_log", ".D"))
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
