"""A lean forward of Llama-family bodies (Llama, SmolLM, Mistral without a window, Qwen2) for the Transformer
drafter: a few-layer drafter stepping a few rows spends more time in transformers' masks, cache objects and dispatch
than in arithmetic. This body calls the model's own modules (embedding, rotary embedding, norms, activation) with one
product for q/k/v and one for gate/up (`_Fused`), prepacked weights (`packed_linear`) and grouped-query attention.
`LlamaBody.of(model)` is None for another layout; `TransformerDrafter` also checks the logits on a probe, so a
look-alike (scaled embeddings, q/k norms, soft-capping) keeps the generic path.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from .targets.cpu_attention import grouped_attention
from .targets.cpu_step import llama_layer
from .kv_state import write_rows
from .packed_linear import PackCache

_BODY = ("embed_tokens", "layers", "norm", "rotary_emb")


class _Fused:
    """Products with the concatenation of some linear layers' weights (and biases), rebuilt whenever one of them is
    another tensor or was edited in place (their storages are held: no new tensor can take an old address)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.held: list = []
        self.weight = self.bias = None
        self.cache = PackCache()

    def linear(self, x: torch.Tensor, *linears: nn.Linear) -> torch.Tensor:
        sources = [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
        key = tuple((t.data_ptr(), t._version, t.dtype, t.shape) for t in sources)
        if key != self.key:
            self.weight = torch.cat([lin.weight.detach() for lin in linears])
            self.bias = None if all(lin.bias is None for lin in linears) else torch.cat(
                [lin.weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias.detach() for lin in linears])
            self.key, self.held = key, [t.untyped_storage() for t in sources]
        return self.cache.linear(x, self.weight, self.bias)


class LlamaBody:
    """The lean forward of a Llama-family body (module doc), reading the body's current modules at every call."""

    def __init__(self, body: nn.Module) -> None:
        self.body = body
        count = len(body.layers)
        self.qkv, self.gate_up = ([_Fused() for _ in range(count)] for _ in range(2))
        self.out, self.down = ([PackCache() for _ in range(count)] for _ in range(2))

    @classmethod
    def of(cls, model: nn.Module) -> LlamaBody | None:
        """The lean body of `model` if its modules have the Llama layout (and nothing else that acts), else None."""
        body = getattr(model, "base_model", None)
        if (body is None or not all(hasattr(body, name) for name in _BODY) or len(body.layers) == 0
                or not all(llama_layer(layer) and hasattr(layer.mlp, "act_fn") for layer in body.layers)):
            return None
        return cls(body)

    def forward(self, ids: torch.Tensor, starts: list[int], positions: torch.Tensor, visible: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """Final hidden states (B, n, d) of `ids` (B, n) at `positions` (B, n) = `starts` (row b's first position) +
        arange(n); each layer's new keys / values go to those slots of its `keys` / `values` (B, kv heads, slots,
        head dim), and query t of row b attends to the slots `visible[b, t]` (B, n, width) marks."""
        batch, n = ids.shape
        width = visible.shape[-1]
        hidden = self.body.embed_tokens(ids)
        cos, sin = (t[:, None] for t in self.body.rotary_emb(hidden, positions))
        mask = visible[:, None]  # (B, 1, n, width)
        for i, layer in enumerate(self.body.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(hidden)
            q, k, v = self.qkv[i].linear(x, attn.q_proj, attn.k_proj, attn.v_proj).split(
                (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features), dim=-1)
            q, k, v = (t.view(batch, n, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            write_rows(keys[i], k, starts, positions)
            write_rows(values[i], v, starts, positions)
            # in the cache's dtype (fp32 on CPU: TransformerDrafter.cache_dtype), a kv head's queries as one block
            attended, _ = grouped_attention(None, q.to(keys[i].dtype), keys[i][:, :, :width], values[i][:, :, :width],
                                            mask, attn.scaling)
            attended = attended.reshape(batch, n, -1).to(hidden.dtype)
            hidden = hidden + self.out[i].linear(attended, attn.o_proj.weight, attn.o_proj.bias)
            x = layer.post_attention_layernorm(hidden)
            gate, up = self.gate_up[i].linear(x, mlp.gate_proj, mlp.up_proj).split(
                (mlp.gate_proj.out_features, mlp.up_proj.out_features), dim=-1)
            hidden = hidden + self.down[i].linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return self.body.norm(hidden)
