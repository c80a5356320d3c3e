"""Target cache: probe verdicts follow the model's attention / dtype / device and live on the model, eager attention
gets the additive mask it expects, commit keeps no token record, prefills run the head on the last position only,
and bf16 targets diverge from their own greedy `generate` only at rounding ties."""
import pytest
import torch
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

import mamba_draft.targets.tree_mask as tree_mask_module
from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets.exact import prepare_target
from mamba_draft.targets.facts import UnsupportedTargetError
from mamba_draft.targets.tree_mask import check_tree_support
from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import aligned_drafter, hf_greedy, prompts, tiny_causal_lm
from tree_search.generate import generate


def test_probe_verdict_is_keyed_on_attention_implementation_and_dtype(monkeypatch):
    model, passed = tiny_causal_lm("llama"), set()
    probed = []
    real_probe = tree_mask_module._probe_tree_mask
    monkeypatch.setattr(tree_mask_module, "_probe_tree_mask", lambda m: probed.append(1) or real_probe(m))
    steps = [
        (lambda: None, 1),                                   # first look: probe
        (lambda: None, 1),                                   # same state: cached
        (lambda: model.set_attn_implementation("eager"), 2),
        (lambda: prepare_target(model.to(torch.bfloat16)), 3),  # a prepared bf16 CPU target: row attention
        (lambda: model.to(torch.float32), 4),                # fp32 keeps row attention: a new one
        (lambda: model.set_attn_implementation("sdpa"), 4),  # back to the first state: its verdict still holds
        (lambda: model.to(torch.bfloat16), 4),  # unprepared bf16: the compiled step verifies, transformers never does
    ]
    for change, expected in steps:
        change()
        check_tree_support(model, passed)
        assert len(probed) == expected
    # the verdicts live where the caller keeps them (no module-level cache): none kept, the probe runs again
    assert len(passed) == 4
    model.to(torch.float32)
    check_tree_support(model)
    assert len(probed) == 5


def _unmasked_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention implementation that drops every mask (each query sees every key)."""
    return eager_attention_forward(module, query, key, value, None, **kwargs)


def test_switching_to_a_mask_ignoring_attention_is_refused_after_a_passing_probe():
    AttentionInterface.register("tree_test_unmasked", _unmasked_attention)
    model, passed = tiny_causal_lm("llama"), set()
    check_tree_support(model, passed)  # sdpa passes and its verdict is kept
    model.set_attn_implementation("tree_test_unmasked")
    with pytest.raises(UnsupportedTargetError, match="LlamaForCausalLM ignores 4D attention masks.*tree_test_unmasked"):
        check_tree_support(model, passed)


@pytest.mark.parametrize("kind", ["llama", "neox", "mistral", "qwen2"])
def test_eager_attention_targets_are_lossless(tmp_path, kind):
    target = tiny_causal_lm(kind, sliding_window=256) if kind == "mistral" else tiny_causal_lm(kind)
    drafter = aligned_drafter(tmp_path, target)
    target.set_attn_implementation("eager")
    assert target.config._attn_implementation == "eager"
    check_tree_support(target)
    accepted = []
    for prompt in prompts(64, 3, seed=11):
        result = generate(target, drafter, prompt, max_new_tokens=40, tree="3,2,1")
        assert torch.equal(result.tokens, hf_greedy(target, prompt, 40))
        accepted.append(result.stats.mean_accepted)
    assert max(accepted) > 1.5  # trees were really accepted, so the tree mask was exercised beyond the root


def test_commit_keeps_no_token_record(monkeypatch):
    """The committed tokens are the caller's; commit only compacts the cache (no per-round torch.cat)."""
    target = tiny_causal_lm("llama")
    tree = TreeConfig((2, 1)).build()
    state = TargetCache(target)
    state.prefill(torch.tensor([[1, 2, 3]]))
    state.tree_forward(torch.tensor([[4, 5, 6, 7, 8]]), tree)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or real_cat(*a, **k))
    state.commit([[1, 3]])
    assert cats == [] and state.slots == 6 and state.positions.tolist() == [6]
    assert not hasattr(state, "ids")


# bf16 keeps 8 significant bits, so a logit z is stored with a spacing (ulp) of up to 2^-7 |z|. The tree forward and the
# one-token forward run the same math in different shapes (other reduction orders, other padded kernels), so every
# layer's activations carry different rounding and the final logits differ by a few ulps of the largest logit.
# Greedy can only diverge where the target's own top-2 logits are that close. 4 * 2^-7 * max|z| (4 ulps of the largest
# logit) covers what we measured (gaps at divergences of 0 to 0.8 * 2^-7 * max|z|: exact bf16 ties or one ulp) with
# margin, yet stays far below the gaps a real error (wrong mask or position) opens, which are of the logit spread.
BF16_TIE = 4 * 2.0**-7
BF16_NEW_TOKENS = 24


@pytest.mark.parametrize("kind", ["llama", "neox", "qwen2"])
def test_bf16_targets_diverge_only_at_rounding_ties(tmp_path, kind):
    target = tiny_causal_lm(kind)
    drafter = aligned_drafter(tmp_path, target)
    prepare_target(target.to(torch.bfloat16))
    identical, cases = 0, prompts(64, 30, seed=21, max_len=8)
    for prompt in cases:
        start = prompt.shape[1]
        reference = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=BF16_NEW_TOKENS,
                                    do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ours = generate(target, drafter, prompt, max_new_tokens=BF16_NEW_TOKENS, tree="3,2,1").tokens[0, start:]
        theirs = reference.sequences[0, start:]
        diverged = (ours != theirs).nonzero()
        if diverged.numel() == 0:
            identical += 1
            continue
        # the target's own one-token logits at the first diverging position (the prefixes agree up to it)
        first = int(diverged[0])
        logits = reference.logits[first][0].float()
        gap = float(logits.max() - logits[ours[first]])
        assert gap <= BF16_TIE * float(logits.abs().max()), (
            f"prompt {prompt.tolist()} diverged at new token {first}: our token's logit is {gap:.4f} below the top"
        )
    # divergences are rare rounding ties, not the rule
    assert identical >= 0.7 * len(cases), f"only {identical}/{len(cases)} prompts identical"


@pytest.mark.parametrize("kind", ["llama", "neox", "qwen2"])
def test_prefills_run_the_head_on_the_last_position_only(kind):
    """A prefill needs one row of logits: the head (49k x 576 on the real pair, a fifth of its prefill) must not run
    over the whole prompt; the logits are the full forward's last ones."""
    model = tiny_causal_lm(kind)
    head_rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[1]))
    ids = torch.tensor([[3, 9, 4, 1, 7, 2]])
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        head_rows.clear()
        single = TargetCache(model).prefill(ids)
        batch = TargetCache(model).prefill(torch.cat([ids, torch.tensor([[0, 0, 5, 6, 8, 2]])]),
                                                torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]))
    hook.remove()
    assert head_rows == [1, 1]
    assert single.shape == (1, 64)
    torch.testing.assert_close(single[0], full)
    torch.testing.assert_close(batch[0], full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batch[1], model(torch.tensor([[5, 6, 8, 2]])).logits[0, -1], rtol=1e-4, atol=1e-5)
