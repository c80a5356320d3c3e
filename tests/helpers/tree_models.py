"""Tiny random targets (Llama, GPT-NeoX) and Mamba drafters with the same vocabulary, for tree-search tests.

`aligned_drafter` copies the target's embeddings and output head into a Mamba drafter and shrinks both models'
mixing layers, so the target is close to a bigram model the drafter reproduces: it agrees often, not always,
which makes acceptance non-trivial without any training.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from mamba_draft import MambaDrafter


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, head_scale: float = 1.0,
               max_positions: int = 512):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    _finish(model, head_scale)
    return model.eval()


def tiny_neox(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, head_scale: float = 1.0,
              max_positions: int = 512):
    torch.manual_seed(seed)
    config = transformers.GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    model = transformers.GPTNeoXForCausalLM(config)
    _finish(model, head_scale)
    return model.eval()


def tiny_causal_lm(kind: str, vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, **extra):
    """A tiny random Mistral / Qwen2 / Llama / GPT-NeoX causal LM (the attention families tree verification supports)."""
    if kind == "llama":
        return tiny_llama(vocab, hidden, layers, seed)
    if kind == "neox":
        return tiny_neox(vocab, hidden, layers, seed)
    torch.manual_seed(seed)
    config_cls, model_cls = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_cls(**{
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False, **extra})
    model = model_cls(config)
    _finish(model, 1.0)
    return model.eval()


def _finish(model, head_scale: float) -> None:
    """Random init is near-uniform; perturb weights and scale the head so distributions are peaked and varied."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.get_output_embeddings().weight.mul_(head_scale)


def random_drafter(directory: Path, vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 1,
                   head_scale: float = 1.0) -> MambaDrafter:
    """A random Mamba-1 drafter saved in HF format and loaded back through MambaDrafter.from_pretrained."""
    torch.manual_seed(seed)
    config = transformers.MambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, state_size=8,
                                      expand=2, conv_kernel=4, tie_word_embeddings=False)
    model = transformers.MambaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(directory)
    return MambaDrafter.from_pretrained(str(directory))


def aligned_drafter(directory: Path, target, mixing_scale: float = 0.15, seed: int = 1) -> MambaDrafter:
    """A Mamba drafter that mostly agrees with `target` (shrinks the target's mixing layers in place).

    Target: output projections of attention and MLP scaled by `mixing_scale`, so its logits are close to
    head(norm(embedding)). Drafter: the same embedding (rows centred, so GPT-NeoX's LayerNorm equals the
    drafter's RMSNorm), the same head, and Mamba mixers scaled the same way.
    """
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    torch.manual_seed(seed)
    config = transformers.MambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, state_size=8,
                                      expand=2, conv_kernel=4, tie_word_embeddings=False,
                                      layer_norm_epsilon=getattr(target.config, "rms_norm_eps", None)
                                      or target.config.layer_norm_eps)
    drafter = transformers.MambaForCausalLM(config)
    with torch.no_grad():
        embed = target.get_input_embeddings().weight
        embed.sub_(embed.mean(dim=1, keepdim=True))
        for name, p in target.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "attention.dense.weight", "mlp.dense_4h_to_h.weight")):
                p.mul_(mixing_scale)
            if name.endswith(("attention.dense.bias", "mlp.dense_4h_to_h.bias")):
                p.zero_()
        drafter.backbone.embeddings.weight.copy_(embed)
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight)
        for layer in drafter.backbone.layers:
            layer.mixer.out_proj.weight.mul_(mixing_scale)
    drafter.save_pretrained(directory)
    return MambaDrafter.from_pretrained(str(directory))


def prompts(vocab: int, count: int, seed: int = 0, min_len: int = 1, max_len: int = 12) -> list[torch.Tensor]:
    """`count` random prompts (1, L) with lengths in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]


def hf_greedy(target, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """The target's own greedy generation (the reference for losslessness)."""
    return target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                           do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)


def draft_subset(vocab: int, size: int, used: list[int], seed: int = 0) -> torch.Tensor:
    """A draft vocabulary of `size` distinct ids in a shuffled order (so column j is not id j): half of them taken
    from `used` (ids the target really emits, most frequent first), the rest from ids not in `used`."""
    counts = torch.bincount(torch.as_tensor(used, dtype=torch.long), minlength=vocab)
    frequent = [int(i) for i in counts.argsort(descending=True) if counts[i] > 0][: size // 2]
    g = torch.Generator().manual_seed(seed)
    unused = [int(i) for i in torch.randperm(vocab, generator=g) if counts[i] == 0][: size - len(frequent)]
    ids = torch.tensor(frequent + unused)
    if ids.numel() != size:
        raise ValueError(f"cannot pick {size} ids: {len(frequent)} used and {len(unused)} unused available")
    return ids[torch.randperm(size, generator=g)]


class SizedTokenizer:
    """Stands in for a tokenizer where only len(tokenizer) (its real vocabulary) matters."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def encoded_cache(model, ids: torch.Tensor):
    """The cache of encoding `ids` (B, L) in one plain forward: the reference our caches are compared with."""
    from mamba_draft.targets.facts import cache_keyword

    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_keyword(model): cache})
    return cache


def word_tokenizer(words, chat_template: str | None = None):
    """A whitespace word-level fast tokenizer over `words` (id 0 is [UNK]), with a chat template if given."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
