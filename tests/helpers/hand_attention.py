"""A causal LM whose attention is written by hand, as remote-code and older models are: it never asks transformers'
AttentionInterface, so no attention implementation can be swapped into it (what `make_exact` must refuse)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class HandConfig(PretrainedConfig):
    model_type = "hand_attention"

    def __init__(self, vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_attention_heads, self.num_hidden_layers = num_attention_heads, num_hidden_layers
        super().__init__(**kwargs)


class HandAttention(nn.Module):
    def __init__(self, config: HandConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, n, width = x.shape
        q, k, v = (t.view(batch, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, n, width))


class HandForCausalLM(PreTrainedModel):
    config_class = HandConfig

    def __init__(self, config: HandConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HandAttention(config) for _ in range(config.num_hidden_layers))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, **_) -> CausalLMOutputWithPast:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return CausalLMOutputWithPast(logits=self.head(h))
