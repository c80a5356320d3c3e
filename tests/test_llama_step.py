"""The Transformer drafter's lean Llama-family body (mamba_draft/llama_step.py): it runs where it gives the model's own
logits (Llama, Qwen2 with its q/k/v biases), rows of different lengths, forks and blocks included; a look-alike that
computes something else keeps transformers' path; edits of the weights after construction reach the next step."""
import copy

import pytest
import torch
import transformers
from torch import nn

from mamba_draft.llama_step import LlamaBody
from mamba_draft.transformer import TransformerDrafter
from tests.helpers.tree_models import tiny_llama

VOCAB = 64


def tiny_qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def rows_against_forward(drafter: TransformerDrafter, model, atol: float) -> None:
    """Two rows of different lengths prefill, step, fork and read a block: every logit is the model's own."""
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
    close = lambda got, want: torch.allclose(got.float(), want, atol=atol, rtol=atol)
    state = drafter.allocate_state(4)
    first, _ = drafter.prefill(ids[:1, :5], state.rows(0, 1))
    second, _ = drafter.prefill(ids[1:, :9], state.rows(1, 2))
    assert close(first[0], ref[0, 4]) and close(second[0], ref[1, 8])
    stepped = drafter.step(torch.stack([ids[0, 5], ids[1, 9]]), state.rows(0, 2))
    assert close(stepped, torch.stack([ref[0, 5], ref[1, 9]]))
    state.gather_(2, torch.tensor([1, 0]))
    block = drafter.extend(torch.stack([ids[1, 10:16], ids[0, 6:12]]), state.rows(2, 4))
    assert close(block[0], ref[1, 10:16]) and close(block[1], ref[0, 6:12])


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_the_lean_body_gives_the_models_own_logits(make):
    model = make()
    drafter = TransformerDrafter(model)
    assert drafter.lean is not None
    rows_against_forward(drafter, model, atol=1e-5)


def test_the_lean_body_in_bf16_tracks_transformers_path():
    """In bf16 (prepacked products on CPUs that take them) the lean body rounds differently from transformers'
    attention, by about one bf16 step of the logits."""
    model = tiny_llama(vocab=VOCAB).to(torch.bfloat16)
    drafter = TransformerDrafter(model)
    assert drafter.lean is not None
    rows_against_forward(drafter, model, atol=5e-2)


def test_a_look_alike_keeps_transformers_path():
    """Another layout (q/k norms, as Qwen3 has) is not taken; one whose logits differ (here doubled by its forward)
    fails the probe, and the drafter then gives that model's logits."""
    model = tiny_llama(vocab=VOCAB)
    normed = copy.deepcopy(model)
    normed.model.layers[0].self_attn.q_norm = nn.Identity()
    assert LlamaBody.of(normed) is None and TransformerDrafter(normed).lean is None
    doubled = copy.deepcopy(model)
    forward = doubled.forward
    doubled.forward = lambda *args, **kwargs: type(out := forward(*args, **kwargs))(logits=2 * out.logits)
    drafter = TransformerDrafter(doubled)
    assert drafter.lean is None
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(drafter(ids), 2 * model(ids).logits, atol=1e-5)


def test_weight_edits_reach_the_next_step():
    """The concatenated q/k/v and gate/up weights are rebuilt after an in-place edit or a replaced layer."""
    model = tiny_llama(vocab=VOCAB)
    drafter = TransformerDrafter(model)
    rows_against_forward(drafter, model, atol=1e-5)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(-2.0)
        model.model.layers[1].mlp.up_proj.bias = None
        gate = model.model.layers[1].mlp.gate_proj
        replaced = nn.Linear(gate.in_features, gate.out_features, bias=False)
        replaced.weight.copy_(torch.randn_like(gate.weight))
        model.model.layers[1].mlp.gate_proj = replaced
    rows_against_forward(drafter, model, atol=1e-5)
