"""Prepacked bf16 linear layers (mamba_draft/packed_linear.py): the same bits as F.linear, and never a stale copy."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mamba_draft.packed_linear import PackCache, PackedLinear, pack_linears, packs_exactly
from tests.helpers.tree_models import tiny_llama

PACKS = packs_exactly(torch.randn(8, 16).bfloat16())  # this CPU's oneDNN takes bf16 (not under an AVX2 cap)
needs_packing = pytest.mark.skipif(not PACKS, reason="oneDNN here does not pack bf16 weights")


def bf16_llama():
    return tiny_llama(vocab=64, hidden=64).to(torch.bfloat16)


@needs_packing
def test_a_packed_model_gives_the_same_bits_and_keeps_its_state_dict():
    model = bf16_llama()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        keys = list(model.state_dict())
        swapped = pack_linears(model)
        got = model(ids).logits
    assert swapped == sum(1 for m in model.modules() if isinstance(m, PackedLinear)) > 0
    assert torch.equal(got, want)
    assert list(model.state_dict()) == keys
    assert pack_linears(model) == 0  # already packed
    twin = copy.deepcopy(model)  # packed copies are not copied; the twin packs its own
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, want)


def test_fp32_layers_stay_plain():
    model = tiny_llama(vocab=64, hidden=64)
    assert pack_linears(model) == 0 and not any(isinstance(m, PackedLinear) for m in model.modules())


def test_in_place_edits_replaced_tensors_and_dtype_changes_repack():
    weight = torch.randn(32, 16).bfloat16()
    cache, x = PackCache(), torch.randn(3, 16).bfloat16()
    with torch.no_grad():
        assert torch.equal(cache.linear(x, weight), F.linear(x, weight))
        weight.mul_(2)  # in place: a new version
        assert torch.equal(cache.linear(x, weight), F.linear(x, weight))
        other = torch.randn(32, 16).bfloat16()  # another tensor of the same shape
        assert torch.equal(cache.linear(x, other), F.linear(x, other))
        view = weight[:20]  # a view of the packed weight's storage: other rows, other shape
        assert torch.equal(cache.linear(x, view), F.linear(x, view))
        assert torch.equal(cache.linear(x.float(), weight.float()), F.linear(x.float(), weight.float()))


def test_module_to_and_back_and_training_go_through_the_current_weight():
    linear = PackedLinear.wrap(torch.nn.Linear(16, 8).bfloat16())
    x = torch.randn(4, 16).bfloat16()
    with torch.no_grad():
        linear(x)
        linear.float()
        assert linear.weight.dtype == torch.float32 and linear.cache.packed is None  # dropped with the old weight
        assert torch.equal(linear(x.float()), F.linear(x.float(), linear.weight, linear.bias))
        linear.bfloat16()
        linear.weight.add_(1)
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    linear.requires_grad_(True)
    linear(x).float().sum().backward()  # autograd: through F.linear
    assert linear.weight.grad is not None and linear.weight.grad.shape == linear.weight.shape


@needs_packing
def test_ties_survive_packing():
    model = tiny_llama(vocab=64, hidden=64)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model = model.to(torch.bfloat16)
    pack_linears(model)
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight is model.model.embed_tokens.weight


@needs_packing
def test_a_transformer_drafters_draft_head_runs_packed_and_follows_a_new_vocabulary():
    from mamba_draft.transformer import TransformerDrafter

    model = bf16_llama()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    drafter = TransformerDrafter(model, torch.tensor([5, 9, 2, 40]))
    for vocab in ([5, 9, 2, 40], [1, 63, 7]):  # a new vocabulary: a new head, repacked (never the old copy)
        drafter.set_draft_vocab(torch.tensor(vocab))
        logits, _ = drafter.prefill(ids)
        assert drafter.head_cache.packed is not None
        packed, drafter.head_cache = drafter.head_cache, Plain()
        assert torch.equal(logits, drafter.prefill(ids)[0])
        drafter.head_cache = packed


class Plain:
    def linear(self, x, weight, bias=None):
        return F.linear(x, weight, bias)
