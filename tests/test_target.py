"""Target cache on one prompt (a batch of one): tree forward == plain forward per path, KV compaction ==
re-encoding, refusals name the class."""
import pytest
import torch
import transformers

from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets.facts import UnsupportedTargetError, window_capacity
from mamba_draft.targets.tree_mask import check_tree_support
from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import encoded_cache, tiny_causal_lm
from tree_search.generate import generate

KINDS = ["llama", "neox", "mistral", "qwen2"]


@pytest.fixture(scope="module", params=KINDS)
def target(request):
    return tiny_causal_lm(request.param, sliding_window=64) if request.param == "mistral" else tiny_causal_lm(request.param)


@pytest.mark.parametrize("prompt_len", [1, 6])
def test_tree_forward_matches_plain_forward_on_every_path(target, prompt_len):
    torch.manual_seed(prompt_len)
    tree = TreeConfig((3, 2, 1)).build()
    prompt = torch.randint(0, 64, (1, prompt_len))
    state = TargetCache(target)
    assert (state.prefill(prompt[:, :-1]) is None) == (prompt_len == 1)  # an empty prefix prefills nothing
    tokens = torch.cat([prompt[0, -1:], torch.randint(0, 64, (len(tree) - 1,))])[None]
    logits, hidden = state.tree_forward(tokens, tree, want_hidden=True)
    assert logits.shape == (1, len(tree), 64) and hidden.shape == (1, len(tree), target.config.hidden_size)
    # the hidden states are what the head consumes (DropMatch / AutoJudge rely on it)
    torch.testing.assert_close(target.get_output_embeddings()(hidden), logits, atol=1e-5, rtol=1e-5)
    assert state.forwards == (1 if prompt_len == 1 else 2)  # an empty prefill runs no forward
    with torch.no_grad():
        for node in range(len(tree)):
            sequence = torch.cat([prompt[0], tokens[0, tree.path_to(node)]])
            plain = target(sequence[None]).logits[0, -1]
            torch.testing.assert_close(logits[0, node], plain, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("branching", [(2, 2, 2), (1, 1, 1)])
def test_commit_equals_reencoding_over_several_rounds(target, branching):
    torch.manual_seed(0)
    tree = TreeConfig(branching).build()
    prompt = torch.randint(0, 64, (1, 5))
    state = TargetCache(target)
    state.prefill(prompt[:, :-1])
    committed = prompt[:, :-1]  # what the cache should hold: the prefix, then each round's root + accepted path
    root = prompt[0, -1]
    # a chain's accepted nodes already sit after the root (nothing moves); a tree's move down
    paths = ([], [1, 2, 3], [1], [1, 2]) if branching == (1, 1, 1) else \
        ([], list(tree.leaf_paths[5]), list(tree.leaf_paths[2][:2]), [2])
    for path in paths:
        tokens = torch.cat([root.view(1), torch.randint(0, 64, (len(tree) - 1,))])
        state.tree_forward(tokens[None], tree)
        state.commit([path])
        committed = torch.cat([committed, tokens[[0] + path].view(1, -1)], dim=1)
        reference = encoded_cache(target, committed)
        # one unpadded row: its slots are its committed sequence, all valid, no holes
        assert state.cache.get_seq_length() == state.slots == committed.shape[1]
        assert state.positions.tolist() == [committed.shape[1]] and bool(state.valid.all())
        for ours, ref in zip(state.cache.layers, reference.layers, strict=True):
            torch.testing.assert_close(ours.keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(ours.values, ref.values, atol=1e-5, rtol=1e-4)
        root = torch.randint(0, 64, ())


def test_flash_attention_is_refused_with_the_class_name():
    model = tiny_causal_lm("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedTargetError, match="LlamaForCausalLM.*flash_attention_2"):
        check_tree_support(model)


class MaskIgnoringLlama(transformers.LlamaForCausalLM):
    """A model that silently drops custom attention masks (falls back to causal attention)."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_a_model_that_ignores_tree_masks_is_detected():
    base = tiny_causal_lm("llama")
    model = MaskIgnoringLlama(base.config).eval()
    model.load_state_dict(base.state_dict())
    with pytest.raises(UnsupportedTargetError, match="MaskIgnoringLlama ignores 4D attention masks"):
        check_tree_support(model)


def test_non_attention_models_are_refused_before_generation(tmp_path):
    from tests.helpers.tree_models import random_drafter

    mamba_target = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    drafter = random_drafter(tmp_path, vocab=64)
    with pytest.raises(UnsupportedTargetError, match="MambaForCausalLM"):
        generate(mamba_target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=4, tree="2,1")


def test_sliding_window_capacity_is_enforced():
    model = tiny_causal_lm("mistral", sliding_window=32)
    assert window_capacity(model) == 31
    assert window_capacity(tiny_causal_lm("qwen2")) is None


def test_caches_go_under_the_keyword_the_installed_transformers_takes(recwarn):
    """`cache` where the forward takes it (transformers >= 5.24: `past_key_values` warns and is removed in 5.40),
    `past_key_values` before; one-prompt and batched generation with a Transformer drafter (its generic path: a
    GPT-NeoX) then raise no deprecation warning."""
    from mamba_draft.targets.facts import cache_keyword
    from mamba_draft.transformer import TransformerDrafter

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None):
            pass

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"
    model, drafter = tiny_causal_lm("llama"), TransformerDrafter(tiny_causal_lm("neox", seed=1))
    assert drafter.lean is None
    prompt = torch.randint(0, 64, (6,)).tolist()
    generate(model, drafter, torch.tensor([prompt]), max_new_tokens=6, tree="2,1")
    generate(model, drafter, [prompt, prompt[2:]], max_new_tokens=6, tree="2,1")
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]
