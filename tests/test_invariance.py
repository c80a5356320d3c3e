"""Batch-invariant verification: in low precision on CPU, speculative output equals plain decoding of the same
model token for token, because no target forward multiplies fewer rows than the probed row floor (dummy leaves
pad it) and low-precision CPU targets use row-stable attention (a node behind masked siblings reduces over its
keys exactly as the decoding step that computes it)."""
from __future__ import annotations

import pytest
import torch

from mamba_draft.heldout import is_heldout, read_spec_bench
from mamba_draft.targets import default_attention, load_causal_lm, load_tokenizer
from tests.helpers.tree_models import random_drafter, tiny_llama
from tree_search.generate import generate, generate_autoregressive
from tree_search.invariance import padded, row_floor
from tree_search.prompts import encode_prompt
from tree_search.target import BatchTargetState, TargetState
from tree_search.tree import Tree, TreeConfig


def test_padded_tree_adds_leaves_no_real_node_sees():
    tree = TreeConfig.parse("2,1").build()
    assert padded(tree, 2) == tree  # (cached per equal tree: not necessarily this object)
    wide = padded(tree, 8)
    assert len(wide) == 8 and wide.parents[: len(tree)] == tree.parents
    assert not wide.ancestor_mask[: len(tree), len(tree):].any()  # real rows never see a dummy


def test_row_floor_is_one_for_fp32_and_probed_for_bf16():
    model = tiny_llama(vocab=64, hidden=32)
    assert row_floor(model) == 1
    model = model.to(torch.bfloat16)
    floor = row_floor(model)
    assert floor in (1, 2, 4, 8, 16, 32, 256)
    # the floor's claim, checked on a fresh product: every larger row count gives the same rows
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(64, linear.in_features).to(torch.bfloat16)
    with torch.no_grad():
        ref = linear(x)
        for m in (floor, 2 * floor, 4 * floor):
            if m <= 64:
                assert torch.equal(torch.cat([linear(x[i:i + m]) for i in range(0, 64, m)]), ref)
    assert default_attention(torch.bfloat16, "cpu") == "row_stable" and default_attention(torch.float32, "cpu") == "sdpa"


@pytest.mark.parametrize("batch", [1, 3])
def test_dummy_rows_change_nothing_and_leave_the_cache_as_without_them(batch):
    """Padding a forward with dummy leaves (min_rows) returns the same real rows and commits the same cache."""
    torch.manual_seed(0)
    model = tiny_llama(vocab=64, hidden=32)
    tree = TreeConfig.parse("2,1").build()
    prompt = torch.randint(0, 64, (batch, 6))
    tokens = torch.randint(0, 64, (batch, len(tree)))
    results = []
    for min_rows in (1, 16):
        state = BatchTargetState(model, min_rows=min_rows) if batch > 1 else TargetState(model, min_rows=min_rows)
        state.prefill(prompt)
        logits, hidden = state.tree_forward(tokens if batch > 1 else tokens[0], tree, want_hidden=True)
        if batch > 1:
            state.commit([[1, 3]] * batch)
        else:
            state.commit([1, 3], len(tree))
        after = state.decode(tokens[:, 0] if batch > 1 else tokens[0, 0])
        keys = state.cache.layers[0].keys
        results.append((logits, hidden, after, keys))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # fp32: 1 vs 16 rows may round differently
    assert results[0][3].shape == results[1][3].shape  # the dummies' keys were dropped


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    target = load_causal_lm("smollm2", dtype=torch.bfloat16)
    drafter = random_drafter(tmp_path_factory.mktemp("drafter"), vocab=49152, hidden=64, layers=1)
    return target, drafter, load_tokenizer("smollm2")


def test_bf16_speculation_equals_plain_decoding_on_the_real_target(bf16_pair):
    """SmolLM2-135M in bf16: tree and chain outputs equal plain (autoregressive) decoding token for token. Without
    the row floor, this machine's kernels made 3 of 6 such prompts drift (a one-row product rounds differently)."""
    target, drafter, tokenizer = bf16_pair
    assert target.config._attn_implementation == "row_stable"
    assert row_floor(target) >= 1
    questions = [r["turns"][0] for r in read_spec_bench() if not is_heldout(r)][::80][:3]
    for text in questions:
        ids = torch.tensor([encode_prompt(tokenizer, text)])[:, -200:]
        plain = generate_autoregressive(target, ids, max_new_tokens=24, temperature=0).new_tokens[0].tolist()
        for tree in ("3,2,1", "1,1"):
            spec = generate(target, drafter, ids, max_new_tokens=24, temperature=0, tree=tree).new_tokens[0].tolist()
            assert spec == plain, (text[:40], tree)


def test_floor_pads_single_token_forwards(bf16_pair):
    target, _, _ = bf16_pair
    state = TargetState(target)
    seen = []
    hook = target.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-1]))
    try:
        state.prefill(torch.tensor([[1, 2, 3]]))
        state.decode(torch.tensor(4))
        state.tree_forward(torch.tensor([5]), Tree((-1,)))
        state.commit([], 1)
    finally:
        hook.remove()
    assert seen == [3, row_floor(target), row_floor(target)] and state.length == 5
    assert state.cache.layers[0].keys.shape[-2] == 5


@pytest.mark.parametrize("tree,tokens", [((-1, 0, 0), 3), ((-1, 0, 0, 0, 2), 5), ((-1, 0, 0, 1, 2), 5)])
def test_a_node_behind_masked_siblings_gets_the_decoding_steps_logits(bf16_pair, tree, tokens):
    """bf16 SmolLM2: the logits of a tree node equal, bit for bit, those plain decoding computes for the same token
    after the same context, though masked siblings sit between the node and its ancestors in the forward (eager
    attention's reductions rounded with that layout: trees 2,1 / 3,1 left plain decoding on 2 of 13 questions)."""
    target, _, tokenizer = bf16_pair
    tree = Tree(tree)
    questions = [r["turns"][0] for r in read_spec_bench() if not is_heldout(r)][5::60][:3]
    g = torch.Generator().manual_seed(0)
    for text in questions:
        ids = torch.tensor([encode_prompt(tokenizer, text)])[:, -120:]
        nodes = torch.randint(100, 20000, (tokens,), generator=g)
        state = TargetState(target)
        state.prefill(ids)
        tree_logits, _ = state.tree_forward(nodes, tree)
        for node in range(len(tree)):
            plain = TargetState(target)
            plain.prefill(ids)
            for i in [0, *tree.path_to(node)]:  # the root, then the node's ancestors and the node itself
                logits = plain.decode(nodes[i])
            assert torch.equal(logits, tree_logits[node]), (text[:30], node)
