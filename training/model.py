"""Build the model being trained (Mamba-1 / Mamba-2 drafter or a small Llama target) and its tokenizer.

Drafters train through mamba_draft's own chunked scans (`MambaDrafter.train_forward`): transformers' kernel-free
Mamba path is O(B·L²) on CPU. Parameter names are the HF ones, so a DeepSpeed checkpoint exports to a plain
`MambaForCausalLM` / `Mamba2ForCausalLM` directory.
"""
from __future__ import annotations

import math

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutput

from mamba_draft import MambaConfig, MambaDrafter
from mamba_draft.checkpoint import load_checkpoint
from mamba_draft.targets import load_causal_lm, load_tokenizer as target_tokenizer
from training.config import ModelConfig
from training.target_features import fed_features, own_features


class TrainableDrafter(MambaDrafter):
    """A MambaDrafter whose forward is the differentiable full-sequence pass (what DeepSpeed's engine calls);
    `hf_config` is the transformers config the run's model/ directory and the export are written with."""

    def __init__(self, hf_config: transformers.PretrainedConfig):
        super().__init__(MambaConfig.from_hf_dict(hf_config.to_dict()), backend="torch")
        self.hf_config = hf_config
        if self.reads_target:  # read outside its owner's forward: ZeRO-3 must gather it for ours
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter

            register_external_parameter(self, self.backbone.stand_in)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.backbone.embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                features: torch.Tensor | None = None, known: torch.Tensor | None = None,
                own: torch.Tensor | None = None, **_) -> CausalLMOutput:
        """Logits and the final-norm state (the feature loss's input). A drafter that reads the target takes
        `features` (B, L, H), the target's state before each token (None: the stand-in everywhere); only the `known`
        (B, L) rows of it are read, the others get the stand-in; `own` (B, L) rows read the drafter's own state at
        the row before instead (`training.target_features`). attention_mask is unused: padding is on the right."""
        if known is not None:
            if features is None:
                raise ValueError("known marks rows of features: pass features too")
            features = fed_features(features, known, self.backbone.stand_in)
        if own is not None:
            with torch.no_grad():
                first = self.train_forward(input_ids, features)[1]
            features = own_features(features, own, first)
        logits, hidden = self.train_forward(input_ids, features)
        return CausalLMOutput(logits=logits, hidden_states=(hidden,))


class DraftHead(torch.nn.Module):
    """A Transformer's output layer scoring only the draft vocabulary during training (logits (.., |draft|), like a
    Mamba drafter's). The weight keeps its parameter name, so checkpoints export to the full-vocabulary model."""

    def __init__(self, head: torch.nn.Linear, draft_ids: torch.Tensor):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.register_buffer("draft_ids", torch.as_tensor(draft_ids, dtype=torch.long), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.draft_ids]
        return torch.nn.functional.linear(hidden, self.weight[self.draft_ids], bias)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    if not name_or_path:
        raise ValueError("model.tokenizer is empty: name the target's tokenizer (hub id or local path)")
    tokenizer = target_tokenizer(name_or_path)  # an HF directory or hub id, a .gguf file, or 'smollm2'
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no eos token; packing, chat rendering and replies need one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padded positions carry label -100, so the id is irrelevant
    return tokenizer


def model_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> transformers.PretrainedConfig:
    """HF config for a model trained from scratch; vocab defaults to the tokenizer's, padded to a multiple."""
    vocab = cfg.vocab_size or math.ceil(len(tokenizer) / cfg.pad_vocab_multiple) * cfg.pad_vocab_multiple
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=cfg.tie_word_embeddings)
    shape = dict(vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers, **special)
    mamba = dict(state_size=cfg.state_size, expand=cfg.expand, conv_kernel=cfg.conv_kernel,
                 use_bias=False, use_conv_bias=True)  # use_bias False = mamba_ssm layout
    if cfg.target_hidden_size:  # MambaConfig reads it
        mamba["target_hidden_size"] = cfg.target_hidden_size
    if cfg.arch == "mamba1":
        return transformers.MambaConfig(**shape, **mamba)
    if cfg.arch == "mamba2":
        return transformers.Mamba2Config(**shape, **mamba, head_dim=cfg.head_dim, n_groups=cfg.n_groups,
                                         num_heads=cfg.num_heads or cfg.expand * cfg.hidden_size // cfg.head_dim)
    if cfg.arch == "llama":
        heads = cfg.num_heads or max(1, cfg.hidden_size // 64)
        return transformers.LlamaConfig(
            **shape, num_attention_heads=heads, num_key_value_heads=cfg.num_key_value_heads or heads,
            intermediate_size=cfg.intermediate_size or 4 * cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings)
    raise ValueError(f"model.arch must be mamba1, mamba2 or llama, got {cfg.arch!r}")


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int,
                draft_ids: torch.Tensor | None = None) -> torch.nn.Module:
    """A fresh model (seeded init) or `init_from` weights (Mamba: a TrainableDrafter), with the draft vocabulary
    `draft_ids` if given and the embedding copied from `init_embeddings_from` if set."""
    fusion, fresh_fusion = {}, False
    if cfg.init_from:
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(cfg, tokenizer), dtype=torch.float32)
    check_vocab(model.config, tokenizer, cfg.init_from or "model")
    if model.config.model_type in ("mamba", "mamba2"):
        fusion, fresh_fusion = fusion_tensors(model.config, cfg)
        drafter = TrainableDrafter(model.config)
        drafter.load_hf_state_dict({**fusion, **model.state_dict()})
        model = drafter
    elif draft_ids is not None:
        model.set_output_embeddings(DraftHead(model.get_output_embeddings(), draft_ids))
        model.draft_ids = draft_ids  # written next to the checkpoints (write_model_dir), exported with them
    if cfg.init_embeddings_from:
        copy_target_embeddings(model, cfg.init_embeddings_from)
    if fresh_fusion:  # target states enter at the scale of the token embeddings they join
        embedding = model.get_input_embeddings().weight
        model.backbone.feature_norm.weight.data.fill_(float(embedding.detach().float().pow(2).mean().sqrt()))
    if isinstance(model, MambaDrafter):
        model.set_draft_vocab(draft_ids)
    model.get_input_embeddings().weight.requires_grad_(not cfg.freeze_embeddings)
    return model.train()


def fusion_tensors(config: transformers.PretrainedConfig, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], bool]:
    """The input fusion of a drafter that reads the target ({} for one that does not), and whether it is fresh.

    model.target_hidden_size sets `config.target_hidden_size` (written with the model), which may turn an `init_from`
    external drafter into one that reads the target. The fusion is `init_from`'s own if it has one, else the identity
    on the token embedding and zero on the target state, with a zero stand-in (the drafter starts as the external
    one it would otherwise be; the target half trains from there)."""
    have = getattr(config, "target_hidden_size", 0) or 0
    if have and have != cfg.target_hidden_size:
        raise ValueError(f"model.init_from {cfg.init_from!r} reads a target state {have} wide: set "
                         f"model.target_hidden_size {have}, not {cfg.target_hidden_size}")
    if not cfg.target_hidden_size:
        return {}, False
    config.target_hidden_size = cfg.target_hidden_size
    config.drafted_features = cfg.drafted_features
    if cfg.init_from:
        _, tensors = load_checkpoint(cfg.init_from)
        own = {k: v for k, v in tensors.items()
               if k.startswith(("backbone.fuse.", "backbone.stand_in", "backbone.feature_norm."))}
        if own:
            return own, False
    d, width = config.hidden_size, config.target_hidden_size
    return {"backbone.fuse.weight": torch.cat([torch.eye(d), torch.zeros(d, width)], dim=1),
            "backbone.stand_in": torch.zeros(width), "backbone.feature_norm.weight": torch.ones(width)}, True


def copy_target_embeddings(model: torch.nn.Module, target_path: str) -> None:
    """Start from the target's input embedding (same width): the target's embedding space from step 0."""
    source = load_causal_lm(target_path, attn_implementation=None).get_input_embeddings().weight.detach()
    weight = model.get_input_embeddings().weight
    if source.shape[1] != weight.shape[1]:
        raise ValueError(f"model.init_embeddings_from {target_path!r}: its embedding width {source.shape[1]} != "
                         f"model.hidden_size {weight.shape[1]}")
    rows = min(source.shape[0], weight.shape[0])
    with torch.no_grad():
        weight[:rows].copy_(source[:rows])


def frequency_ranked_vocab(token_lists, size: int, always: tuple[int, ...] = (), vocab: int | None = None) -> torch.Tensor:
    """FR-Spec's draft vocabulary: `always` ids (end-of-turn tokens must stay proposable however rare), then the
    most frequent ids of `token_lists` (ties by id), then — when the data has fewer than `size` distinct ids and
    `vocab` is given — unseen ids in id order (a BPE tokenizer numbers tokens in merge order, which follows its
    training corpus's frequencies)."""
    counts = torch.zeros(0, dtype=torch.long)
    for ids in token_lists:
        ids = torch.as_tensor(ids, dtype=torch.long)
        grown = torch.bincount(ids[ids >= 0], minlength=counts.numel())
        grown[:counts.numel()] += counts
        counts = grown
    seen = torch.nonzero(counts).flatten()
    order = seen[torch.argsort(counts[seen], descending=True, stable=True)]
    forced = torch.tensor([i for i in dict.fromkeys(always) if i is not None and i >= 0], dtype=torch.long)
    ranked = torch.cat([forced, order[~torch.isin(order, forced)]])[: max(size, len(forced))]
    if vocab is not None and ranked.numel() < size:
        unseen = torch.ones(vocab, dtype=torch.bool)
        unseen[ranked[ranked < vocab]] = False
        ranked = torch.cat([ranked, torch.nonzero(unseen).flatten()[: size - ranked.numel()]])
    return ranked


def check_vocab(config: transformers.PretrainedConfig, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but {name} vocab_size is {config.vocab_size}: "
                         "token ids would index past the embedding table; use the model's own tokenizer "
                         "or a larger model.vocab_size")


def frozen_target(name: str, what: str, tokenizer: PreTrainedTokenizerBase, device, dtype: torch.dtype, **options):
    """The target a run distills from or scores against (`what` names its config key), frozen. HF dir, hub id or
    .gguf; batched forwards need no row blocks (`mamba_draft.targets.row_blocks`)."""
    target = load_causal_lm(name, dtype=dtype, device=device, row_blocks=False, **options)
    check_vocab(target.config, tokenizer, f"{what} {name!r}")
    return target.requires_grad_(False)


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay on norms, biases and the SSM's A_log / D (as mamba_ssm marks them)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith(("A_log", ".D")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
